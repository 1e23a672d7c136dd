"""build_engine_client: the EngineClient an EngineArgs asks for (vLLM's build_async_engine_client).

One engine (AsyncLLM), or data-parallel replicas behind a router (DPAsyncLLM) when
--data-parallel-size > 1 or replicas of other nodes join this one. `llmctl serve`, the Ray Serve
app and `LLM` all start their engine here.
"""

from __future__ import annotations

from llmctl.engine.client.protocol import EngineClient


def build_engine_client(engine_args, progress=None) -> EngineClient:
    """Load the model and start serving it; raises what building the engine raised."""
    if engine_args.data_parallel_size > 1 or engine_args.data_parallel_placement().multi_node:
        from llmctl.engine.dp.dp_async_llm import DPAsyncLLM

        return DPAsyncLLM.from_engine_args(engine_args, progress)
    from llmctl.engine.client.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(engine_args, progress)
