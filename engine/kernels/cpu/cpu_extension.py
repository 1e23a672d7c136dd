"""Building the CPU kernels (paged attention, quantized matmul): one C++ source compiled once per
machine with torch.utils.cpp_extension into a cache directory, then loaded as torch ops.

Each build's name hashes everything the binary depends on (source, flags, torch, Python, the CPU's
features: the machine's, LLMCTL_CPU_FLAGS_OFF hides none from it), so several builds load side
by side in one process and a changed machine rebuilds.
Builders of one directory serialise on an flock, which the kernel releases if a builder dies.
A LLMCTL_CACHE_DIR with no build of a name yet loads the one `make setup` left in torch's
extensions directory, if any, instead of compiling again (a fresh cache is a first start).

The kernels build for -march=native unless LLMCTL_CPU_MARCH names another target (gcc's -march
values, e.g. `znver3` or `x86-64-v3`): a build for an older CPU than the one it runs on, to measure
what that CPU's code path does here (a Zen 4 running the code a Zen 3 gets, say). A value the
compiler refuses leaves the kernel unbuilt, and its warning quotes the compiler.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from llmctl.engine import envs

logger = logging.getLogger("llmctl")

_BUILT_MARKER = "built.ok"


def build_spec(
    source: Path | tuple[Path, ...], prefix: str, march: str, extra_cflags: tuple[str, ...]
) -> tuple[str, list[str], list[str]]:
    """(extension name, cflags, ldflags); the name hashes everything the binary depends on.
    `source`: one C++ file, or the files of one extension (.cpp compiled, headers hashed)."""
    # The machine's flags, not cpu_flags(): hiding flags (LLMCTL_CPU_FLAGS_OFF) changes which
    # paths the Python side takes, not what the compiler emits, so those runs share the build.
    from llmctl.engine.platform import machine_cpu_flags

    if march == "native":
        march = envs.LLMCTL_CPU_MARCH
        if not re.fullmatch(r"[A-Za-z0-9._-]+", march):
            raise ValueError(
                f"LLMCTL_CPU_MARCH={march!r} is not a -march value: use one word such as "
                "znver3 or x86-64-v3, or unset it to build for this CPU"
            )
    cflags = ["-O3", f"-march={march}", "-fopenmp", *extra_cflags]
    ldflags = ["-fopenmp"]  # resolves to the libgomp torch already loaded (same soname)
    key = hashlib.sha256()
    for path in _files(source):
        key.update(path.read_bytes() + b"\0")
    for part in (
        " ".join(cflags),
        " ".join(ldflags),
        torch.__version__,
        sys.version,
        " ".join(sorted(machine_cpu_flags())),
    ):
        key.update(b"\0" + part.encode())
    return f"{prefix}_{key.hexdigest()[:16]}", cflags, ldflags


def _files(source: Path | tuple[Path, ...]) -> tuple[Path, ...]:
    return (source,) if isinstance(source, Path) else tuple(source)


def compile_extension(
    source: Path | tuple[Path, ...],
    prefix: str,
    what: str,
    march: str,
    extra_cflags: tuple[str, ...],
) -> str:
    """Compile (or load the cached build of) `source` for -march=`march`; returns its op
    namespace name (`getattr(torch.ops, name)`). `what` names the kernel in the log and the
    spinner. Raises when it cannot be built (no compiler, ninja or header)."""
    name, cflags, ldflags = build_spec(source, prefix, march, extra_cflags)
    build_dir = build_root() / name
    prebuilt = _setup_build(name, build_dir)
    if prebuilt is not None:
        torch.ops.load_library(str(prebuilt))
        return name
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    with exclusive(build_dir.with_suffix(".lock")):
        if (build_dir / _BUILT_MARKER).exists() and library.exists():
            torch.ops.load_library(str(library))
        else:
            # torch's own lock is a file that a killed build leaves behind, after which every
            # load() waits forever. Builders of this directory all hold the flock above, so a
            # lock file found here is stale.
            with contextlib.suppress(FileNotFoundError):
                (build_dir / "lock").unlink()
            from torch.utils import cpp_extension  # imports setuptools: ~0.2 s

            compiler = os.environ.get("CXX", "c++")  # what cpp_extension runs
            if not shutil.which(compiler):
                raise RuntimeError(f"no C++ compiler ({compiler}) on PATH; install g++")
            logger.info("Compiling the %s (once) into %s", what, build_dir)
            with ninja_on_path(), build_spinner(what):
                cpp_extension.load(
                    name=name,
                    sources=[str(p) for p in _files(source) if p.suffix in (".cpp", ".cc")],
                    extra_cflags=[*cflags, f"-DLLMCTL_OP_NAMESPACE={name}"],
                    extra_ldflags=ldflags,
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=False,
                )
            (build_dir / _BUILT_MARKER).touch()
    return name


def build_root() -> Path:
    if envs.LLMCTL_CACHE_DIR:
        return Path(envs.LLMCTL_CACHE_DIR) / "torch_extensions"
    return _torch_root()


def _torch_root() -> Path:
    """torch's extensions directory (cpp_extension.get_default_build_root), without importing
    cpp_extension (and with it setuptools, ~0.2 s of every start) where torch's appdirs answer."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    try:
        from torch._appdirs import user_cache_dir
    except ImportError:
        from torch.utils.cpp_extension import get_default_build_root

        return Path(get_default_build_root())
    return Path(os.path.realpath(user_cache_dir(appname="torch_extensions")))


def _setup_build(name: str, build_dir: Path) -> Path | None:
    """The library of this name that `make setup` built in torch's extensions directory, for a
    LLMCTL_CACHE_DIR that holds no build of it yet: a fresh cache directory would otherwise
    compile for 10-40 s at the first engine start. The name hashes everything the binary
    depends on, and a finished build never changes, so it loads without the lock."""
    if build_dir.exists():
        return None  # this cache's own build (or a build of it under way) comes first
    setup_dir = _torch_root() / name
    library = setup_dir / f"{name}.so"
    if setup_dir != build_dir and (setup_dir / _BUILT_MARKER).exists() and library.exists():
        logger.debug("loading the %s build from %s", name, setup_dir)
        return library
    return None


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """An flock: held by one process at a time, released by the kernel if that process dies."""
    import fcntl

    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """load() runs `ninja` from PATH; the venv's ninja is not on it unless the venv is active."""
    if shutil.which("ninja"):
        yield
        return
    candidates = [Path(sys.executable).parent]
    with contextlib.suppress(ImportError):
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([*map(str, candidates), old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


@contextlib.contextmanager
def build_spinner(what: str) -> Iterator[None]:
    """On a terminal, a spinner with the elapsed time while the compiler runs (10-40 s)."""
    from llmctl.engine.progress import stderr_console

    console = stderr_console()
    if not console.is_terminal:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        bar.add_task(f"Compiling the {what} (once per machine)", total=None)
        yield


def first_error_line(e: Exception) -> str:
    lines = str(e).splitlines() or [type(e).__name__]
    errors = [line.strip() for line in lines if "error:" in line]
    return (errors or lines)[0][:300]
