"""`llmctl serve`: the OpenAI-compatible API server on the bundled engine.

Parse the options into EngineArgs, call `run_server`; the server logs the KV-cache lines, then the
address it listens on, and runs until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from llmctl.cli.console import CliState
from llmctl.cli.engine_options import (
    BlockSize,
    DistributedExecutorBackend,
    Dtype,
    EnablePrefixCaching,
    KvCacheSpaceGib,
    MaxModelLen,
    MaxNumBatchedTokens,
    MaxNumSeqs,
    Model,
    PipelineLayerPartition,
    PipelineParallelSize,
    TensorParallelSize,
    engine_kwargs,
)

app = typer.Typer()
_SERVER = "Server"


@app.command()
def serve(
    ctx: typer.Context,
    model: Model = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on.", rich_help_panel=_SERVER)
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", rich_help_panel=_SERVER)] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require `Authorization: Bearer KEY` on every route but /health. "
            "(default: $LLMCTL_API_KEY, else none)",
            show_default=False,
            rich_help_panel=_SERVER,
        ),
    ] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            help="The model name clients send. (default: the model's name)",
            show_default=False,
            rich_help_panel=_SERVER,
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help="On SIGTERM, seconds to let in-flight requests finish.",
            rich_help_panel=_SERVER,
        ),
    ] = 30.0,
    dtype: Dtype = "auto",
    max_model_len: MaxModelLen = None,
    kv_cache_space_gib: KvCacheSpaceGib = None,
    block_size: BlockSize = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    enable_prefix_caching: EnablePrefixCaching = None,
    tensor_parallel_size: TensorParallelSize = None,
    pipeline_parallel_size: PipelineParallelSize = None,
    distributed_executor_backend: DistributedExecutorBackend = None,
    pipeline_layer_partition: PipelineLayerPartition = None,
) -> None:
    """Serve a model with an OpenAI-compatible API (/v1/completions, /v1/chat/completions).

    Try it: curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json'
    -d '{"prompt": "The capital of France is", "max_tokens": 16}'
    """
    state: CliState = ctx.obj or CliState()
    from llmctl.engine.config import EngineArgs
    from llmctl.engine.progress import rich_progress
    from llmctl.engine.server.api_server import run_server

    engine_args = EngineArgs(
        model=model, served_model_name=served_model_name, **engine_kwargs(locals())
    )
    key = api_key or os.environ.get("LLMCTL_API_KEY") or None
    if state.progress:
        with rich_progress() as progress:
            run_server(engine_args, host, port, key, shutdown_timeout, progress)
    else:
        run_server(engine_args, host, port, key, shutdown_timeout)
