"""llmctl's Ray Serve application (engine/entrypoints/ray_serve_app.py) as Ray Serve builds it
from a config's `args:`, without a Ray cluster: the deployment's resources for the layout, the args
typed as `serve run key=value` gives them, and typed errors before any replica starts. (Serving
through Ray Serve: tests/e2e/test_ray_serve_app.py.)"""

from __future__ import annotations

import pytest

from llmctl.engine.entrypoints.ray_serve_app import build_app, deployment_options, split_args
from llmctl.engine.errors import ConfigError


def deployment(app):
    """The application's deployment as Ray Serve's config schema spells it."""
    from ray.serve.deployment import deployment_to_schema

    return deployment_to_schema(app._bound_deployment)  # the deployment the Application binds


# fmt: off
def test_build_app_gives_the_layouts_resources_and_typed_args():
    # As `serve run llmctl.engine.entrypoints.ray_serve_app:build_app model=/m ...` passes them.
    app = build_app({"model": "/m", "tensor_parallel_size": "2", "pipeline_parallel_size": "2",
                     "device": "cpu", "enforce_eager": "true", "kv_cache_space_gib": "0.5"})
    d = deployment(app)
    assert d.name == "LLMServer"
    assert d.ray_actor_options.num_cpus == 1 and d.ray_actor_options.num_gpus is None
    assert d.placement_group_bundles == [{"CPU": 2}, {"CPU": 1}, {"CPU": 1}, {"CPU": 1}]
    assert d.placement_group_strategy == "PACK"  # stages may span nodes
    assert (d.health_check_period_s, d.health_check_timeout_s) == (10, 30)
    engine, server = app._bound_deployment.init_args  # what each replica's LLMServer gets
    assert engine == {"model": "/m", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                      "device": "cpu", "enforce_eager": True, "kv_cache_space_gib": 0.5}
    assert server == {}
# fmt: on


def test_deployment_options_follow_ray_serve_llm():
    assert deployment_options(1, 1, gpu=True) == {
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}
    }
    assert deployment_options(2, 1, gpu=True) == {
        "ray_actor_options": {"num_cpus": 1},
        "placement_group_bundles": [{"CPU": 1, "GPU": 1}, {"GPU": 1}],
        "placement_group_strategy": "STRICT_PACK",
    }


def test_bad_args_fail_when_the_app_is_built():
    with pytest.raises(ConfigError) as info:
        build_app({"model": "/m", "tensor_parralel_size": 2})
    assert "unknown args for LLMServer: tensor_parralel_size" in info.value.message
    assert "tensor_parallel_size" in info.value.hint
    with pytest.raises(ConfigError, match="tensor_parallel_size='two' is not an int"):
        build_app({"tensor_parallel_size": "two"})
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        build_app({"device": "tpu"})  # EngineArgs' own check, before any replica
    with pytest.raises(ConfigError) as info:
        build_app({"data_parallel_size": 2})
    assert "set the deployment's num_replicas" in info.value.hint
    with pytest.raises(ConfigError, match="nnodes, master_addr: the mp backend's multi-node"):
        build_app({"nnodes": 2, "master_addr": "10.0.0.1"})


def test_server_options_go_to_the_server():
    engine, server = split_args({"model": "/m", "api_key": "k", "http_timeout": "5"})
    assert engine == {"model": "/m"} and server == {"api_key": "k", "http_timeout": 5.0}
