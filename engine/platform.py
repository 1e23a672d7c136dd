"""What the device can do: which device to use, which dtype is fast on it, CPU tuning."""

from __future__ import annotations

import ctypes
import fnmatch
import functools
import gc
import logging
import os
from dataclasses import dataclass

from llmctl.engine import envs
from llmctl.engine.errors import ConfigError

logger = logging.getLogger("llmctl")


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def triton_available() -> bool:
    """Triton is installed (its kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def default_device() -> str:
    return "cuda" if cuda_available() else "cpu"


def resolve_device(device: str) -> str:
    """auto: cuda when torch sees a GPU, else cpu. cuda where torch sees none: ConfigError."""
    if device == "auto":
        return default_device()
    if device == "cuda" and not cuda_available():
        import torch

        why = f"torch {torch.__version__}"
        why += f" with CUDA {torch.version.cuda}" if torch.version.cuda else ", a CPU-only build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            why += f", CUDA_VISIBLE_DEVICES={visible!r}"
        raise ConfigError(
            f"device cuda was asked for, but torch sees no CUDA device ({why})",
            "use --device cpu (or auto, which picks the CPU here), or run on a machine with an "
            "NVIDIA GPU and a CUDA build of torch",
        )
    return device


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), less those LLMCTL_CPU_FLAGS_OFF names.

    LLMCTL_CPU_FLAGS_OFF: a comma list of flags or shell patterns (`amx*,avx512*`) treated as
    absent, so one machine can run the code paths of an older CPU (with LLMCTL_CPU_MARCH for
    what the compiler emits). This is the one place that reads it."""
    off = envs.LLMCTL_CPU_FLAGS_OFF or ()
    return {f for f in machine_cpu_flags() if not any(fnmatch.fnmatchcase(f, p) for p in off)}


def machine_cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo gives them (none hidden): what a build for
    -march=native depends on."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True)
class CpuPath:
    """Which CPU code path the engine takes, decided from the CPU's flags (`cpu_path()`).

    amx: AMX-BF16 tiles; avx512_bf16: AVX512-BF16 dot products (Zen 4, Cooper Lake); avx2: AVX2
    with FMA; baseline: neither. On the first two the activations are bfloat16 (dtype "auto",
    quantized weights included) and a quantized matmul of more than a few rows expands bfloat16
    tiles of its weight for oneDNN's bfloat16 GEMM kernel (AMX or AVX512-BF16); on the others
    activations are float32 and the tiles float32, for torch's float32 GEMM. On avx512_bf16
    with AVX512-VNNI (Zen 4) prefill batches of quantized weights run on int8 activations
    (`int8_prefill`, kernels/cpu/int8_gemm.cpp; LLMCTL_CPU_INT8_PREFILL=0 turns it off); on
    avx2, 4-bit weights' prefill batches do, on VPMADDUBSW, in place of the float32 GEMM (dtype
    "auto" only: `int8_activations`).
    """

    name: str
    bf16_tiles: bool  # batched quantized matmuls through bfloat16 tiles
    # prefill batches of quantized weights on int8 activations (int8_gemm.cpp): AVX512-VNNI
    # (avx512_bf16), VPMADDUBSW for 4-bit weights (avx2)
    int8_prefill: bool = False

    @property
    def activation_dtype(self) -> str:
        return "bfloat16" if self.bf16_tiles else "float32"

    def describe(self) -> str:
        tiles = "bfloat16" if self.bf16_tiles else "float32"
        gemm = {"amx": "AMX", "avx512_bf16": "AVX512-BF16"}.get(self.name, "float32")
        prefill = ""
        if self.int8_prefill and self.bf16_tiles:
            prefill = (
                "; prefill batches of quantized weights on int8 activations (AVX512-VNNI, "
                "LLMCTL_CPU_INT8_PREFILL=0 for bfloat16)"
            )
        elif self.int8_prefill:
            prefill = (
                "; batches of 64 rows or more of 4-bit weights on int8 activations under dtype "
                "auto (AVX2 VPMADDUBSW, LLMCTL_CPU_INT8_PREFILL=0 for float32)"
            )
        return (
            f"CPU path {self.name}: {self.activation_dtype} activations by default; batched "
            f"quantized matmuls expand {tiles} weight tiles for the {gemm} GEMM{prefill}; int4 "
            f"decode in {self.int4_decode}"
        )

    @property
    def int4_decode(self) -> str:
        """How the decode kernels (quantized_matmul_cpu.cpp) multiply int4 weights here."""
        return {
            "amx": "512-bit float32 loops",
            "avx512_bf16": "AVX512-BF16 dot products on the bfloat16 activations",
            "avx2": "256-bit float32 loops",
        }.get(self.name, "scalar loops")


def cpu_path(flags: set[str] | None = None) -> CpuPath:
    """The code path for `flags` (default: this CPU's, LLMCTL_CPU_FLAGS_OFF applied)."""
    flags = cpu_flags() if flags is None else flags
    if {"amx_bf16", "amx_tile"} <= flags:
        return CpuPath("amx", bf16_tiles=True)
    if "avx512_bf16" in flags:
        int8 = {"avx512_vnni", "avx512bw"} <= flags and envs.LLMCTL_CPU_INT8_PREFILL
        return CpuPath("avx512_bf16", bf16_tiles=True, int8_prefill=int8)
    if {"avx2", "fma"} <= flags:
        return CpuPath("avx2", bf16_tiles=False, int8_prefill=envs.LLMCTL_CPU_INT8_PREFILL)
    return CpuPath("baseline", bf16_tiles=False)


@functools.cache
def log_cpu_path() -> CpuPath:
    """This process's CPU path, said once in the log (at a CPU worker's start)."""
    path = cpu_path()
    logger.info("%s", path.describe())
    return path


def int8_activations(dtype: str, device: str) -> bool:
    """Whether a model's 4-bit packed weights take int8 activations for float32 batches
    (ModelConfig.int8_activations): on the avx2 CPU path with int8_prefill, under dtype "auto"
    only. dtype="float32" asked for by name keeps float32 activations everywhere, the float
    path's numerics (resolve_dtype's promise)."""
    if dtype != "auto" or device != "cpu":
        return False
    path = cpu_path()
    return path.name == "avx2" and path.int8_prefill


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matmuls at twice the float32 rate or more."""
    return cpu_path().bf16_tiles


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None) -> str:
    """Turn "auto" into the dtype that is fast on `device`.

    CUDA: the checkpoint's dtype (float16 for float32 checkpoints, as vLLM does).
    CPU: the CPU path's activation dtype (`cpu_path()`), for float and quantized weights alike:
    bfloat16 with native bfloat16 (AVX512-BF16, AMX), as vLLM's CPU backend does; float32
    without it, because emulated bfloat16 matmuls are several times slower. Quantized weights
    follow the same rule: their batched matmuls run bfloat16 tiles through the same GEMM as the
    float path, and their decode kernels widen bfloat16 activations in registers.
    Pass dtype="float32" explicitly for outputs identical to Hugging Face's float32 model.
    """
    if dtype != "auto":
        if device == "cpu" and dtype == "float16":
            raise ConfigError(
                "float16 is not supported on the CPU",
                "use --dtype float32 (or bfloat16)",
            )
        return dtype
    if device == "cuda":
        if checkpoint_dtype in (None, "float32"):
            return "float16"
        return checkpoint_dtype
    return cpu_path().activation_dtype


def torch_dtype(dtype: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def tune_cpu_allocator() -> None:
    """Keep freed activation buffers in the heap instead of returning them to the kernel.

    glibc serves allocations above the mmap threshold with fresh pages, so every step pays page
    faults for its multi-megabyte activations and KV gathers; a high threshold lets the heap reuse
    them. (vLLM's CPU backend gets the same effect by preloading tcmalloc.)
    """
    if envs.LLMCTL_NO_MALLOC_TUNING:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    except (OSError, AttributeError):
        logger.debug("mallopt unavailable; leaving the allocator as it is")


def release_free_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc's malloc_trim), once, after loading:
    with the thresholds above the heap never shrinks by itself, so the load's temporaries (GGUF
    blocks decoded while packing, checkpoint shards) would stay resident for the whole run."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_frozen = 0  # engines of this process whose start-up heap is frozen


def freeze_startup_heap() -> None:
    """Move every object alive now (the loaded model's modules, the tokenizer, the engine) out of
    the cyclic garbage collector's sight, as vLLM does once its engine is up. A step allocates
    enough short-lived objects to set off full collections, and each walked the ~190,000 objects
    of the bundled model's engine: ~2% of a single stream's decode on the Zen 4 kind. Undone by
    `thaw_startup_heap` when the engine shuts down, so that an engine built and dropped inside a
    longer-lived process (a notebook) is collected as before. LLMCTL_NO_GC_FREEZE=1: not done."""
    global _frozen
    if envs.LLMCTL_NO_GC_FREEZE:
        return
    gc.collect()
    gc.freeze()
    _frozen += 1


def thaw_startup_heap() -> None:
    """An engine that froze the heap shut down: the collector walks all of it again, another
    engine's still running too (until that one stops, its heap is walked as before the freeze:
    the stopped engine's memory coming back matters more)."""
    global _frozen
    if _frozen:
        _frozen -= 1
        gc.unfreeze()


def check_fp8(device: str) -> None:
    """UnsupportedQuantizationError saying what to change when block-FP8 weights cannot run
    on `device` (this torch build, this GPU)."""
    import torch

    from llmctl.engine.errors import UnsupportedQuantizationError
    from llmctl.engine.layers.quantization.fp8 import check_fp8_device

    if not hasattr(torch, "float8_e4m3fn"):
        raise UnsupportedQuantizationError(
            f"this torch build ({torch.__version__}) has no float8_e4m3fn dtype for FP8 weights",
            "install torch 2.1 or newer",
        )
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    check_fp8_device(device, capability, triton_available())


def passive_openmp_waits() -> None:
    """Make this process's OpenMP threads sleep when they wait, instead of spinning: call it in a
    worker process before torch is imported (libgomp reads OMP_WAIT_POLICY once, as it loads).

    By default libgomp spins a thread that waits at a barrier or for the next parallel region
    (GOMP_SPINCOUNT, 300,000 pauses) before it sleeps. With every core busy, the spinning thread
    holds a core that the thread it waits for needs: two pipeline stages of 2 threads each on 2
    cores (two nodes on one machine, or any busy machine) spent half their cycles in libgomp's
    spin and ran 10-20x slower than one process group (docs/benchmarks.md, "Pipeline stages
    across nodes"). A passive wait costs a futex wake per region instead, which the benchmarks
    do not see. A policy the user set is kept."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
