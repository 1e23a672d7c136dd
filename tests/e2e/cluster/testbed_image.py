"""The llmctl image on the test bed: built by `llmctl image build --debootstrap` on the root Docker
daemon, saved once to a tar (cached per image id), and loaded into each host's daemon. A host's
daemon keeps its data root between runs, so after a change to llmctl's sources it already has the
image's lower layers (the Debian base, the 2.5 GB of dependencies): it is given a thin tar, the
same manifest and config with only the layers it lacks (~9 MB instead of 3.2 GB), which `docker
load` accepts because it looks each layer up by its chain id before it reads the layer's file.

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

from testbed_os import CommandError, TestbedError, run

from llmctl.cluster.launch.image_file import ImageFile, layers_held, read_image_file, write_thin

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
    for old in images.glob("*.tar"):  # ID.tar, and ID.from-N.tar (thin_file)
        if not old.name.startswith(tar.stem) and image_id(f"sha256:{old.name[:64]}") is None:
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


def images_layers(docker_host: str) -> list[list[str]]:
    """The layer lists of every image the daemon holds."""
    listed = run(["docker", "-H", docker_host, "image", "ls", "-q", "--no-trunc"], timeout=60)
    ids = sorted(set(listed.stdout.split()))
    if not ids:
        return []
    argv = ["docker", "-H", docker_host, "image", "inspect", "--format", "{{json .RootFS.Layers}}"]
    return [json.loads(line) or [] for line in run([*argv, *ids], timeout=60).stdout.splitlines()]


def thin_file(saved: ImageFile, skip: int) -> Path:
    """The saved tar without its `skip` lowest layers (next to it, made once), by the code
    `cluster up --image-file` sends nodes with (cluster/launch/image_file.py)."""
    tar = Path(saved.path)
    if skip == 0:
        return tar
    thin = tar.with_name(f"{tar.stem}.from-{skip}.tar")
    if not thin.exists():
        write_thin(saved, skip, thin.with_suffix(".partial")).replace(thin)
    return thin


def load(root: Path, tag: str, docker_hosts: Sequence[str], log: Callable[[str], None] = print):
    """Give every daemon in docker_hosts the root daemon's `tag` (same image id), where it is
    missing or different: in parallel, each the layers it lacks (thin_file)."""
    t0 = time.monotonic()
    wanted = root_image_id(tag)
    missing = [h for h in docker_hosts if image_id(tag, h) != wanted]
    if not missing:
        log(f"testbed: {tag} already on every host ({time.monotonic() - t0:.1f} s)")
        return
    tar = image_file(root, tag, log)
    saved = read_image_file(str(tar), tag)
    stack = saved.layers
    held = {h: layers_held(stack, images_layers(h)) for h in missing}
    for count in set(held.values()):  # hosts that hold the same layers share one file
        thin_file(saved, count)

    def load_one(docker_host: str) -> str:
        start = time.monotonic()
        part = thin_file(saved, held[docker_host])
        shipped = f"{len(stack) - held[docker_host]} of {len(stack)} layers"
        try:
            run(["docker", "-H", docker_host, "load", "-i", part], timeout=1800)
        except CommandError as e:  # a daemon that reads every layer file: give it them all
            if part == tar:
                raise
            log(f"testbed: {docker_host} refused the thin tar ({e}); loading the whole image")
            run(["docker", "-H", docker_host, "load", "-i", tar], timeout=1800)
            part, shipped = tar, f"all {len(stack)} layers"
        if image_id(tag, docker_host) != wanted:
            raise TestbedError(f"{docker_host}: {tag} has another id after docker load")
        # The image `tag` named before, now untagged.
        run(["docker", "-H", docker_host, "image", "prune", "-f"], timeout=600)
        size = part.stat().st_size / 1e6
        return f"{docker_host} {time.monotonic() - start:.1f} s ({shipped}, {size:,.0f} MB)"

    with ThreadPoolExecutor(len(missing)) as pool:
        per_host = ", ".join(pool.map(load_one, missing))
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
