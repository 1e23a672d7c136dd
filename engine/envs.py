"""Every environment variable llmctl reads for itself, declared once: name, type, default, help.

    from llmctl.engine import envs
    if envs.LLMCTL_FUSED_DECODE: ...

Each attribute read parses `os.environ` at that moment, so a test's `monkeypatch.setenv`, or a
worker process's inherited environment, is what the code sees; a value that does not parse is a
ConfigError naming the variable and what it accepts. Nothing else in llmctl reads `os.environ` for
an LLMCTL_* name (tests/unit/test_envs.py checks the sources). Other programs' variables
(CUDA_VISIBLE_DEVICES, RAY_ADDRESS, NCCL_*, TORCH_EXTENSIONS_DIR) are read where they are used:
they are not our knobs; nor are run_cluster.sh's own, which the shell script reads.
docs/serving.md's table of them is `markdown_table()`'s output.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmctl.engine.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str], Any]
    accepts: str  # what a value may be, for the error and the docs
    help: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError:
            raise ConfigError(
                f"{self.name}={raw!r} is not {self.accepts}",
                f"set {self.name} to {self.accepts}, or unset it (default: {self.default!r})",
            ) from None


def _flag(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(raw)


def _choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(raw)
        return raw

    return parse


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        value = kind(raw)
        if not value > 0:
            raise ValueError(raw)
        return value

    return parse


def _optional_text(raw: str) -> str | None:
    return raw or None


def _patterns(raw: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


_FLAG = "0 or 1"
_VARIABLES = (
    EnvVar(
        "LLMCTL_API_KEY", None, _optional_text, "a string",
        "The API key `llmctl serve` requires (`Authorization: Bearer KEY`) when --api-key is "
        "not given. Safer than the flag: it does not show in `ps`.",
    ),
    EnvVar(
        "LLMCTL_ATTENTION_BACKEND", "auto", _choice("auto", "torch", "triton"),
        "auto, torch or triton",
        "The attention backend: auto is Triton's kernels on CUDA and the torch backend (with the "
        "C++ paged decode kernel) on the CPU; triton on the CPU needs TRITON_INTERPRET=1.",
    ),
    EnvVar(
        "LLMCTL_CACHE_DIR", None, _optional_text, "a directory",
        "Where llmctl keeps what it derives from models and builds: GGUF files' configs and "
        "tokenizers (gguf/) and the compiled CPU kernels (torch_extensions/). Default: "
        "~/.cache/llmctl for the former, torch's extension directory for the latter.",
    ),
    EnvVar(
        "LLMCTL_CLUSTER_SECRET", None, _optional_text, "a string of 16 characters or more",
        "The cluster's secret: nodes (--nnodes > 1) and data-parallel replicas of other nodes "
        "prove to each other that they hold it when they join, before anything they send is "
        "read (--cluster-secret-file instead names a file holding it). The same on every node; "
        "`llmctl cluster up` gives each of its nodes one.",
    ),
    EnvVar(
        "LLMCTL_CONFIGURE_LOGGING", True, _flag, _FLAG,
        "`LLM()` shows the engine's INFO lines on stderr when the program configured no logging "
        "(vLLM's VLLM_CONFIGURE_LOGGING); 0: leave logging alone.",
    ),
    EnvVar(
        "LLMCTL_CPU_DEVICES", None, _positive(int), "a positive integer",
        "On the CPU, how many ranks this node may host for the executor backend rule (mp when "
        "tp x pp fits, else Ray). Default: the cores this process may use.",
    ),
    EnvVar(
        "LLMCTL_CPU_FLAGS_OFF", None, _patterns, "a comma list of CPU flags or patterns",
        "CPU flags treated as absent when the CPU path is chosen (`amx*`: the AVX512-BF16 "
        "path; `avx512*,amx*`: the AVX2 one), so one machine runs an older CPU's code paths.",
    ),
    EnvVar(
        "LLMCTL_CPU_MARCH", "native", lambda raw: raw or "native", "a gcc -march value",
        "The -march the CPU kernels are compiled for (e.g. x86-64-v3 for an AVX2-only build "
        "on an AVX-512 machine).",
    ),
    EnvVar(
        "LLMCTL_CPU_INT8_PREFILL", True, _flag, _FLAG,
        "On CPUs with AVX512-VNNI and AVX512-BF16 but no AMX (Zen 4), batches of 128 rows or "
        "more (prefill) multiply 4/8-bit weights by int8 activations, quantized per 32 values "
        "as llama.cpp does (~1.35x the bfloat16 GEMMs' rate); on AVX2-only CPUs (Zen 1-3) "
        "the same for 4-bit weights under dtype auto from 64 rows (a prompt of 64 tokens, 64 "
        "sequences decoding; ~2x the float32 GEMMs' rate); 0: "
        "bfloat16 or float32 activations, the float path's numerics.",
    ),
    EnvVar(
        "LLMCTL_CPU_PREPACK", True, _flag, _FLAG,
        "Repack float weights for oneDNN at load on the CPU, and quantized weights' "
        "large-batch bfloat16 expansions as they are made (0: plain F.linear).",
    ),
    EnvVar(
        "LLMCTL_CUSTOM_ALL_REDUCE", True, _flag, _FLAG,
        "Tensor-parallel GPUs of one node with peer access all-reduce tensors up to 8 MiB "
        "through symmetric memory (one kernel) instead of NCCL (0: NCCL always).",
    ),
    EnvVar(
        "LLMCTL_FUSED_LAYER_KERNELS", True, _flag, _FLAG,
        "On the GPU, the layers' fused Triton kernels: RMSNorm with its residual add, rotary "
        "embedding, SiLU-and-mul (0: the plain torch ops, for comparison).",
    ),
    EnvVar(
        "LLMCTL_FUSED_DECODE", True, _flag, _FLAG,
        "Run a small CPU decode step's dense Llama layers in one C++ call (0: layer by layer).",
    ),
    EnvVar(
        "LLMCTL_KNOWN_HOSTS", "~/.ssh/known_hosts", lambda raw: raw or "~/.ssh/known_hosts",
        "a file",
        "The SSH known-hosts file `llmctl cluster` checks node host keys against.",
    ),
    EnvVar(
        "LLMCTL_NO_GC_FREEZE", False, _flag, _FLAG,
        "1: leave the engine's start-up heap in the garbage collector's walks (by default each "
        "process freezes it once up, as vLLM does; the test suite sets this: its one process "
        "builds hundreds of engines, each freeze a full collection of it).",
    ),
    EnvVar(
        "LLMCTL_NO_MALLOC_TUNING", False, _flag, _FLAG,
        "1: leave glibc's malloc thresholds as they are (by default the heap keeps freed "
        "activation buffers for the next step).",
    ),
    EnvVar(
        "LLMCTL_PP_LAYER_PARTITION", None, _optional_text, "comma-separated layer counts",
        "The default of --pipeline-layer-partition (vLLM's VLLM_PP_LAYER_PARTITION), e.g. 13,12.",
    ),
    EnvVar(
        "LLMCTL_RAY_PLACEMENT_TIMEOUT", 60.0, _positive(float), "a positive number of seconds",
        "How long the Ray executor waits for its placement group's bundles.",
    ),
    EnvVar(
        "LLMCTL_SHM_COLLECTIVES", True, _flag, _FLAG,
        "CPU ranks on one node exchange through shared memory instead of Gloo (0: Gloo only).",
    ),
    EnvVar(
        "LLMCTL_SHM_SLOT_BYTES", 8 << 20, _positive(int), "a positive number of bytes",
        "The shared-memory collectives' slot size; larger messages go through Gloo.",
    ),
    EnvVar(
        "LLMCTL_WORKER_START_TIMEOUT", 900.0, _positive(float), "a positive number of seconds",
        "How long the mp executor waits for its workers to load the model and report ready.",
    ),
)  # fmt: skip

VARIABLES: dict[str, EnvVar] = {v.name: v for v in _VARIABLES}


def __getattr__(name: str) -> Any:
    variable = VARIABLES.get(name)
    if variable is None:
        raise AttributeError(f"module 'llmctl.engine.envs' has no attribute {name!r}")
    return variable.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def describe() -> list[tuple[str, str, str]]:
    """(name, default, help) of every variable, for the docs."""
    return [(v.name, "unset" if v.default is None else str(v.default), v.help) for v in _VARIABLES]


def markdown_table() -> str:
    """docs/serving.md's table of the variables (tests/unit/test_envs.py keeps the two equal)."""
    rows = [f"| `{name}` | {default} | {text} |" for name, default, text in describe()]
    return "\n".join(["| variable | default | meaning |", "|---|---|---|", *rows])
