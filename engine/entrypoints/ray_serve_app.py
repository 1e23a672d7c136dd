"""The Ray Serve application of llmctl: one deployment, LLMServer, whose replicas each run an
engine (an EngineClient: AsyncLLM) behind llmctl's own OpenAI-compatible routes
(api_server.build_app).

A RayService's serveConfigV2 (cluster/plan/manifests.py), or `serve run`, names it by import path
and gives its engine options as `args:`, the keywords of EngineArgs (and a few of ServerConfig):

    applications:
    - name: llmctl
      route_prefix: /
      import_path: llmctl.engine.entrypoints.ray_serve_app:build_app
      args: {model: /models/Llama-3.1-70B, tensor_parallel_size: 8, max_model_len: 8192}
      deployments:
      - name: LLMServer
        num_replicas: 2          # data parallel: each replica its own engine and KV cache
        ray_actor_options: {num_cpus: 1}
        placement_group_bundles: [{CPU: 1, GPU: 1}, {GPU: 1}, ...]   # one per rank
        placement_group_strategy: STRICT_PACK

Resources follow Ray Serve LLM's deployments: with tensor_parallel_size x pipeline_parallel_size
> 1, the replica runs the engine on the Ray executor backend, and the replica's placement group
has one bundle per rank; the replica actor (1 CPU) shares bundle 0 with rank 0, and each rank's
actor takes its own bundle (engine/executor/ray.py uses the current placement group). With one
rank, the engine runs in the replica itself, which then asks for the GPU.

Readiness: Ray Serve calls each replica's `check_health` (every health_check_period_s); it
raises the engine's own /health error (dead, restarting, stalled), so Serve stops routing to the
replica and replaces it. Ray Serve's proxy serves every route of the app: /v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics.

This module imports Ray only in `build_app`: `llmctl plan --emit rayservice` uses
`deployment_options` without Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmctl.engine.config.options import RAY_SERVE, cli_options
from llmctl.engine.entrypoints.openai.server_config import ServerConfig
from llmctl.engine.errors import ConfigError

if TYPE_CHECKING:
    from llmctl.engine.client.protocol import EngineClient

logger = logging.getLogger("llmctl")

IMPORT_PATH = "llmctl.engine.entrypoints.ray_serve_app:build_app"
DEPLOYMENT_NAME = "LLMServer"
# ServerConfig's fields a RayService may set (Ray Serve's proxy owns the host, port and shutdown):
# those whose OptionSpec lists RAY_SERVE.
SERVER_KEYS = tuple(o.name for o in cli_options(RAY_SERVE, ServerConfig))
HEALTH_CHECK_PERIOD_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 30.0


def deployment_options(
    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, *, gpu: bool = True
) -> dict[str, Any]:
    """The LLMServer replica's resources for one engine of tp x pp ranks (`gpu`: ranks on
    GPUs, else on CPU cores). Pure: the RayService manifest spells out the same options.

    tp=2 x pp=2 on GPUs: ray_actor_options {num_cpus: 1} and the bundles
    [{CPU: 1, GPU: 1}, {GPU: 1}, {GPU: 1}, {GPU: 1}]: the replica and rank 0 in bundle 0, ranks
    1-3 in bundles 1-3. A tensor-parallel group must sit on one node (STRICT_PACK); pipeline
    stages may span nodes (PACK)."""
    world = tensor_parallel_size * pipeline_parallel_size
    if world == 1:  # the engine runs in the replica (the uni backend)
        return {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1} if gpu else {"num_cpus": 1}}
    # Each rank's actor asks for one GPU and no CPU, or one CPU (engine/executor/ray.py).
    rank_bundle = {"GPU": 1} if gpu else {"CPU": 1}
    first = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 2}
    return {
        "ray_actor_options": {"num_cpus": 1},
        "placement_group_bundles": [first] + [dict(rank_bundle) for _ in range(world - 1)],
        "placement_group_strategy": "STRICT_PACK" if pipeline_parallel_size == 1 else "PACK",
    }


def split_args(args: Mapping[str, Any]) -> tuple[dict, dict]:
    """Ray Serve's `args:` as (EngineArgs keywords, ServerConfig keywords). `serve run
    IMPORT_PATH tensor_parallel_size=2` gives strings: a number or a boolean is converted to
    the option's type. Unknown keys and the options a replica cannot take are typed errors
    naming the fix."""
    from llmctl.engine.config.engine_args import EngineArgs

    engine_keys = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(args) - engine_keys - set(SERVER_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown args for {DEPLOYMENT_NAME}: {', '.join(unknown)}",
            "give EngineArgs keywords (model, tensor_parallel_size, pipeline_parallel_size, "
            f"max_model_len, ...) or {', '.join(SERVER_KEYS)}",
        )
    types = {o.name: o.value_type for o in (*cli_options(None, EngineArgs), *_SERVER_OPTIONS)}
    typed = {k: _typed(k, v, types.get(k)) for k, v in args.items()}
    engine = {k: v for k, v in typed.items() if k in engine_keys}
    server = {k: v for k, v in typed.items() if k in SERVER_KEYS}
    if (engine.get("data_parallel_size") or 1) > 1:
        raise ConfigError(
            "data_parallel_size > 1 in a Ray Serve application: Ray Serve runs the replicas",
            "drop data_parallel_size and set the deployment's num_replicas instead",
        )
    multi_node = ("nnodes", "node_rank", "master_addr", "headless")
    given = [k for k in multi_node if engine.get(k) not in (None, False, 0, 1)]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: the mp backend's multi-node flags, not for a Ray Serve replica",
            "drop them: a replica's ranks are Ray actors in its placement group",
        )
    return engine, server


_SERVER_OPTIONS = cli_options(RAY_SERVE, ServerConfig)
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _typed(name: str, value: Any, kind: type | None) -> Any:
    """A string from `serve run`'s key=value as the option's int, float or bool."""
    if not isinstance(value, str) or kind not in (int, float, bool):
        return value
    try:
        return _BOOLS[value.lower()] if kind is bool else kind(value)
    except (KeyError, ValueError):
        raise ConfigError(
            f"{name}={value!r} is not a{'n' if kind is int else ''} {kind.__name__}",
            f"give {name} as a{'n' if kind is int else ''} {kind.__name__}",
        ) from None


class LLMServer:
    """A Ray Serve replica: an engine and llmctl's FastAPI app over it. Decorated with
    @serve.ingress() and @serve.deployment in `build_app` (Ray is imported there); Ray Serve
    calls `__serve_build_asgi_app__` after `__init__`, and `check_health` periodically."""

    async def __init__(self, engine_kwargs: dict, server_kwargs: dict) -> None:
        from llmctl.engine.client.factory import build_engine_client
        from llmctl.engine.config.engine_args import EngineArgs
        from llmctl.engine.entrypoints.openai.server_config import ServerConfig

        engine_kwargs = dict(engine_kwargs)
        world = int(engine_kwargs.get("tensor_parallel_size") or 1) * int(
            engine_kwargs.get("pipeline_parallel_size") or 1
        )
        if world > 1 and engine_kwargs.get("distributed_executor_backend") is None:
            engine_kwargs["distributed_executor_backend"] = "ray"  # ranks in our bundles
        self.engine_args = EngineArgs(**engine_kwargs)
        self.server_config = ServerConfig(**server_kwargs)
        self.engine_client: EngineClient | None = None
        # The engine builds in its own thread (AsyncLLM.from_engine_args); the replica's event
        # loop stays free meanwhile.
        self.engine_client = await asyncio.to_thread(build_engine_client, self.engine_args)

    def __serve_build_asgi_app__(self):
        from llmctl.engine.entrypoints.openai.api_server import build_app as build_api

        name = self.engine_client.engine.config.model_config.served_model_name
        logger.info("Serving %s as a Ray Serve replica (OpenAI API under /v1)", name)
        return build_api(self.engine_client, name, self.server_config)

    def check_health(self) -> None:
        """Ray Serve's health check: the engine's /health error (dead, restarting, stalled)."""
        error = self.engine_client.health_error()
        if error is not None:
            raise error

    def __del__(self) -> None:
        if getattr(self, "engine_client", None) is not None:
            self.engine_client.shutdown()


def build_app(args: dict[str, Any]):
    """The application `args:` describe: one LLMServer deployment with the resources of its
    layout (deployment_options), which a serve config's `deployments:` may override."""
    import ray
    from ray import serve

    from llmctl.engine.config.engine_args import EngineArgs
    from llmctl.engine.entrypoints.openai.server_config import ServerConfig

    engine, server = split_args(dict(args or {}))
    # Typed errors now, when the application is deployed, not in every replica that starts.
    EngineArgs(**engine)
    ServerConfig(**server)
    device = engine.get("device", "auto")
    if device == "auto":  # where the replicas will run: any GPU in the Ray cluster
        gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    else:
        gpu = device == "cuda"
    options = deployment_options(
        int(engine.get("tensor_parallel_size") or 1),
        int(engine.get("pipeline_parallel_size") or 1),
        gpu=gpu,
    )
    deployment = serve.deployment(
        serve.ingress()(LLMServer),
        name=DEPLOYMENT_NAME,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        **options,
    )
    return deployment.bind(engine, server)
