"""The llmctl image on the test bed: built by `llmctl image build --debootstrap` on the root Docker
daemon, saved once to a tar (cached per image id), and loaded into each host's daemon.

Run as a script, it does all three for the hosts whose daemon sockets it is given, then the same
for the image without Ray (`--no-ray`, TAG-noray) on the first two hosts, the ones the mp-backend
tests serve on (their fixture then finds it up to date instead of building it in the foreground:
about 95 s of the cluster tier). It prints one JSON line and waits for its stdin to close (so that
it stays one live child of the test session until the session has read the result):

    python testbed_image.py TAG ROOT SOCKET... < pipe > result
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from testbed_os import TestbedError, run

LLMCTL = Path(sys.executable).parent / "llmctl"


NO_RAY_SUFFIX = "-noray"  # the tag of the image without Ray: TAG-noray
NO_RAY_HOSTS = 2  # the hosts the mp-backend tests serve on


def build(tag: str, flags: Sequence[str] = ()) -> str:
    """`llmctl image build --debootstrap [flags]` (skipped by llmctl when the sources have not
    changed: the root daemon keeps the image between runs); returns what it printed."""
    argv = [str(LLMCTL), "image", "build", "--debootstrap", *flags, "--tag", tag]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    if result.returncode != 0:
        raise TestbedError(f"llmctl image build failed:\n{result.stdout}\n{result.stderr}")
    return f"{' '.join(argv[1:])}: {result.stdout.strip()}"


def image_id(ref: str, docker_host: str | None = None) -> str | None:
    daemon = ["-H", docker_host] if docker_host else []
    argv = ["docker", *daemon, "image", "inspect", "--format", "{{.Id}}", ref]
    proc = run(argv, check=False, timeout=60)
    return proc.stdout.strip() if proc.returncode == 0 else None


def root_image_id(tag: str) -> str:
    found = image_id(tag)
    if found is None:
        raise TestbedError(f"image {tag} is not in the root Docker daemon; build it first")
    return found


def image_file(root: Path, tag: str, log: Callable[[str], None] = print) -> Path:
    """The root daemon's `tag` as a `docker save` tar under root/images, cached per image id
    (tars of images the root daemon no longer has are deleted)."""
    t0 = time.monotonic()
    wanted = root_image_id(tag)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    tar = images / f"{wanted.removeprefix('sha256:')}.tar"
    for old in images.glob("*.tar"):
        if old != tar and image_id(f"sha256:{old.stem}") is None:
            old.unlink()
    if not tar.exists():
        partial = tar.with_suffix(".partial")
        run(["docker", "save", "-o", partial, tag], timeout=1800)
        if root_image_id(tag) != wanted:  # rebuilt meanwhile: the tar's name would lie
            partial.unlink()
            raise TestbedError(f"{tag} changed while it was being saved; try again")
        partial.replace(tar)
        log(f"testbed: saved {tag} to {tar} in {time.monotonic() - t0:.1f} s")
    return tar


def load(root: Path, tag: str, docker_hosts: Sequence[str], log: Callable[[str], None] = print):
    """Give every daemon in docker_hosts the root daemon's `tag` (same image id), loading the
    cached tar (in parallel) only where it is missing or different."""
    t0 = time.monotonic()
    wanted = root_image_id(tag)
    missing = [h for h in docker_hosts if image_id(tag, h) != wanted]
    if not missing:
        log(f"testbed: {tag} already on every host ({time.monotonic() - t0:.1f} s)")
        return
    tar = image_file(root, tag, log)

    def load_one(docker_host: str) -> float:
        start = time.monotonic()
        run(["docker", "-H", docker_host, "load", "-i", tar], timeout=1800)
        if image_id(tag, docker_host) != wanted:
            raise TestbedError(f"{docker_host}: {tag} has another id after docker load")
        # The image `tag` named before, now untagged.
        run(["docker", "-H", docker_host, "image", "prune", "-f"], timeout=600)
        return time.monotonic() - start

    with ThreadPoolExecutor(len(missing)) as pool:
        took = list(pool.map(load_one, missing))
    per_host = ", ".join(f"{h} {t:.1f} s" for h, t in zip(missing, took, strict=True))
    log(f"testbed: loaded {tag} in {time.monotonic() - t0:.1f} s ({per_host})")


def main(tag: str, root: str, docker_hosts: list[str]) -> None:
    lines: list[str] = []
    try:
        images = [(tag, (), docker_hosts)]
        images.append((tag + NO_RAY_SUFFIX, ("--no-ray",), docker_hosts[:NO_RAY_HOSTS]))
        for name, flags, hosts in images:
            t0 = time.monotonic()
            lines.append(f"testbed: {build(name, flags)} ({time.monotonic() - t0:.1f} s)")
            load(Path(root), name, hosts, lines.append)
        result = {"ok": True, "log": lines}
    except Exception as e:  # noqa: BLE001 - reported to the test session
        result = {"ok": False, "log": lines, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result), flush=True)
    sys.stdin.read()  # until the session closes the pipe


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
