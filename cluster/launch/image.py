"""`llmctl image build`: the llmctl container image every node of a cluster runs.

templates/Dockerfile installs llmctl[ray] into /opt/llmctl (with `--no-ray`, plain llmctl: the image
of the mp backend, which runs across nodes without Ray and is smaller) on one of two bases:
  - cpu:  a slim Debian with Python 3.11 (`python:3.11-slim-bookworm`, or with `--debootstrap`
          a Debian base built locally for machines that reach no registry). The wheels, the CPU
          build of torch included, are built on this machine and copied in: the build is offline.
  - cuda: an NVIDIA CUDA runtime base; llmctl's wheel is copied in, its dependencies (the CUDA
          build of torch) come from PyPI during the build.
The cpu image carries g++ and the engine's CPU kernels (paged attention, the quantized matmuls,
the fused decode step) compiled during the build for the building machine's CPU; a node with
another CPU compiles its own on the first engine start. Without them the engine in a container
fell back to plain torch: ~10x slower decode of the bundled model (150 vs 14 ms a token).
The image carries the hash of llmctl's sources as a label; a build whose hash matches the existing
image's is skipped ("up to date").
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmctl.cluster.errors import ConfigError, ImageBuildError

TARGETS = {
    "cpu": "python:3.11-slim-bookworm",
    "cuda": "nvidia/cuda:12.6.3-runtime-ubuntu24.04",
}
DEBOOTSTRAP_BASE = "llmctl-base:bookworm-cxx"  # with g++: the CPU kernels build in the image
SOURCE_LABEL = "llmctl.source-hash"
RAY_LABEL = "llmctl.ray"  # "yes" or "no": whether the image has Ray
CPU_TORCH = "torch==2.13.0"  # the CPU wheel (see the Makefile); pip finds it on local disk


@dataclass(frozen=True)
class ImageBuild:
    tag: str
    target: str = "cpu"
    base_image: str | None = None  # default: TARGETS[target]
    debootstrap: bool = False  # build the cpu base locally instead of pulling it
    torch_spec: str = CPU_TORCH
    ray: bool = True  # False: no Ray in the image (`--no-ray`, for `cluster up --backend mp`)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ConfigError(
                f"unknown image target {self.target!r}", f"use one of {sorted(TARGETS)}"
            )
        if self.debootstrap and self.target != "cpu":
            raise ConfigError("--debootstrap builds a CPU base", "drop it, or use --target cpu")

    @property
    def base(self) -> str:
        if self.base_image:
            return self.base_image
        return DEBOOTSTRAP_BASE if self.debootstrap else TARGETS[self.target]

    @property
    def extras(self) -> str:
        """llmctl's extras in the image: `[ray]`, or none."""
        return "[ray]" if self.ray else ""


def source_root() -> Path:
    """The llmctl checkout this package was installed from (editable install)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file() or not (root / "templates" / "Dockerfile").is_file():
        raise ImageBuildError(
            f"no llmctl source checkout at {root}",
            "run llmctl image build from a checkout installed with pip install -e .",
        )
    return root


def source_hash(root: Path) -> str:
    digest = hashlib.sha256()
    files = [root / "pyproject.toml", root / "templates" / "Dockerfile"]
    for folder in ("cli", "engine", "cluster"):
        files += sorted(p for p in (root / folder).rglob("*") if p.suffix in (".py", ".cpp"))
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def wheel_argv(build: ImageBuild, root: Path, wheel_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheel_dir)]
    if build.target == "cpu":
        return argv + [f"{root}{build.extras}", build.torch_spec]
    return argv + ["--no-deps", str(root)]  # cuda: dependencies come from PyPI in the build


def split_wheels(context: Path) -> None:
    """Move llmctl's own wheel from deps/ to llmctl/: the two become separate image layers."""
    own = context / "llmctl"
    own.mkdir(exist_ok=True)
    (context / "deps").mkdir(exist_ok=True)
    wheels = list((context / "deps").glob("llmctl-*.whl"))
    if len(wheels) != 1:
        raise ImageBuildError(f"pip wheel made {len(wheels)} llmctl wheels", "run with --force")
    shutil.move(wheels[0], own / wheels[0].name)


def docker_build_argv(build: ImageBuild, context: Path, digest: str) -> list[str]:
    pip_args = "--no-index" if build.target == "cpu" else ""
    return [
        "docker", "build", "--network", "host", "--tag", build.tag,
        "--build-arg", f"BASE_IMAGE={build.base}",
        "--build-arg", f"PIP_INSTALL_ARGS={pip_args}",
        "--build-arg", f"LLMCTL_EXTRAS={build.extras}",
        "--build-arg", f"CPU_KERNELS={'1' if build.target == 'cpu' else ''}",
        "--label", f"{SOURCE_LABEL}={digest}",
        "--label", f"{RAY_LABEL}={'yes' if build.ray else 'no'}",
        "--file", str(context / "Dockerfile"), str(context),
    ]  # fmt: skip


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 `URIs:` or a `deb` line)."""
    candidates = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in candidates + [Path("/etc/apt/sources.list")]:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            words = line.split()
            if len(words) >= 2 and words[0] == "URIs:" and "security" not in words[1]:
                return words[1]
            if len(words) >= 3 and words[0] == "deb" and "security" not in words[1]:
                return words[1]
    return "http://deb.debian.org/debian"


def debootstrap_argv(rootfs: Path, mirror: str) -> list[str]:
    return [
        "debootstrap", "--variant=minbase",
        "--include=python3,python3-venv,ca-certificates,g++",
        "bookworm", str(rootfs), mirror,
    ]  # fmt: skip


def image_label(image: str, label: str) -> str | None:
    template = f'{{{{index .Config.Labels "{label}"}}}}'
    result = subprocess.run(
        ["docker", "image", "inspect", "--format", template, image],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return result.stdout.strip() if result.returncode == 0 else None


def up_to_date(build: ImageBuild, digest: str) -> bool:
    """The tag already holds these sources, with Ray or without as asked."""
    if image_label(build.tag, SOURCE_LABEL) != digest:
        return False
    return (image_label(build.tag, RAY_LABEL) != "no") == build.ray  # older images had Ray


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise ImageBuildError(f"{what} failed: {' / '.join(tail)}", f"the command was: {argv}")


def _check_docker() -> None:
    if shutil.which("docker") is None:
        raise ImageBuildError("docker is not installed", "apt-get install docker.io")
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        raise ImageBuildError("the Docker daemon does not answer", "start dockerd")


def build_debootstrap_base(log: Callable[[str], None]) -> None:
    """A Debian bookworm base (Python 3.11, g++) imported as DEBOOTSTRAP_BASE, built once."""
    if image_label(DEBOOTSTRAP_BASE, "x") is not None:
        return
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed", "apt-get install debootstrap")
    with tempfile.TemporaryDirectory(prefix="llmctl-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log(f"building the Debian base {DEBOOTSTRAP_BASE} with debootstrap (a few minutes, once)")
        _run(debootstrap_argv(rootfs, debian_mirror()), "debootstrap")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            ["docker", "import", "-", DEBOOTSTRAP_BASE], stdin=tar.stdout, capture_output=True,
            text=True, check=False,
        )  # fmt: skip
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise ImageBuildError(
                f"docker import failed: {imported.stderr.strip()}", "check dockerd"
            )


def build_image(
    build: ImageBuild, *, force: bool = False, log: Callable[[str], None] = lambda line: None
) -> tuple[str, bool]:
    """Build the image; returns (source hash, built). Skips a build that is up to date."""
    root = source_root()
    digest = source_hash(root)
    _check_docker()
    if not force and up_to_date(build, digest):
        return digest, False
    if build.debootstrap:
        build_debootstrap_base(log)
    with tempfile.TemporaryDirectory(prefix="llmctl-image-") as tmp:
        context = Path(tmp)
        shutil.copy(root / "templates" / "Dockerfile", context / "Dockerfile")
        log("building wheels")
        _run(wheel_argv(build, root, context / "deps"), "pip wheel")
        split_wheels(context)
        log(f"docker build {build.tag} (base {build.base})")
        replaced = image_label(build.tag, SOURCE_LABEL) is not None and _image_id(build.tag)
        _run(docker_build_argv(build, context, digest), "docker build")
    if replaced and replaced != _image_id(build.tag):
        # The tag's previous llmctl image, now untagged; kept if a container still uses it.
        subprocess.run(["docker", "image", "rm", replaced], capture_output=True, check=False)
    return digest, True


def _image_id(image: str) -> str | None:
    result = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return result.stdout.strip() if result.returncode == 0 else None
