"""llmctl's inference engine: paged KV cache, continuous batching, Megatron-style parallel layers.

Heavy modules (torch, transformers) load on first use, so `from llmctl.engine import
SamplingParams` stays cheap.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# MKL's allocator keeps the buffers of each thread's largest GEMM for the next one, for good: 8 MB
# a thread after the first bfloat16 attention of a prefill (torch's flash attention calls MKL),
# 16 MB of a 2-core server's ~400. Read when torch loads MKL, so set before torch is imported;
# freed and allocated again per call, the same memory costs no measurable time (glibc keeps it).
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

from llmctl.engine.outputs import CompletionOutput, Logprob, RequestOutput
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from llmctl.engine.config.engine_args import EngineArgs
    from llmctl.engine.core.llm_engine import LLMEngine
    from llmctl.engine.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]


def __getattr__(name: str):
    if name == "LLM":
        from llmctl.engine.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from llmctl.engine.core.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from llmctl.engine.config.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'llmctl.engine' has no attribute {name!r}")
