"""llmctl's Ray Serve application, deployed as a RayService deploys it, answers the openai client.

`llmctl plan --device cpu -tp 2 --emit rayservice` for a tiny model gives a serveConfigV2; its
application is deployed on a local Ray as KubeRay submits it (Ray Serve's own deploy of that
config: import_path, args, the deployment's replicas, actor options and placement group), so the
replica builds an engine whose two ranks are Ray actors in the replica's placement group. The
official openai client then gets, through Ray Serve's proxy, the greedy text LLM(...) gives; and
when a rank dies, Ray Serve's health check (the engine's own) replaces the replica.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import yaml

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.kube_options import kube_options
from llmctl.cluster.plan.manifests import manifests
from llmctl.cluster.plan.model_spec import load_model_spec
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine import LLM, SamplingParams
from llmctl.engine.distributed.ports import free_port

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "kv_cache_space_gib": 0.05, "device": "cpu"}


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return tiny_models.path("llama")


@pytest.fixture(scope="module")
def expected(model_path) -> list[str]:
    """The offline engine's greedy text (one process, no Ray)."""
    with LLM(str(model_path), use_tqdm_on_load=False, **ENGINE) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def rayservice_config(model_path, port: int) -> dict:
    """The serveConfigV2 `llmctl plan --emit rayservice` writes for the model at tp=2."""
    plan = make_plan(
        load_model_spec(str(model_path)),
        inventory_from_flags(1, 8, 80.0, "nvlink"),
        PlanOptions(tensor_parallel_size=2, **ENGINE),
    )
    (service,) = manifests(plan, kube_options("rayservice", str(model_path), port=port))
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def wait_running(serve, app: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            pytest.fail(f"the application failed to deploy: {status.message}")
        assert time.monotonic() < deadline, f"not RUNNING after {timeout} s: {status}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def deployed(model_path, expected):
    """The RayService's application on a private local Ray (4 logical CPUs: the replica and
    its two ranks), torn down afterwards."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from ray.serve.schema import ServeDeploySchema

    port = free_port()
    config = rayservice_config(model_path, port)
    assert config["applications"][0]["args"]["model"] == str(model_path)
    # Ray Serve's health check every second instead of every 10 (the restart test waits for it).
    config["applications"][0]["deployments"][0]["health_check_period_s"] = 1
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # What the Ray dashboard does with the config KubeRay submits (PUT /api/serve/applications/)
        from ray.serve.context import _get_global_client

        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        wait_running(serve, "llmctl", timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_openai_client_gets_the_offline_greedy_text(deployed, model_path, expected):
    import openai

    client = openai.OpenAI(base_url=f"{deployed}/v1", api_key="unused", max_retries=0)
    (model,) = client.models.list().data
    got = [
        client.completions.create(
            model=model.id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        ).choices[0].text
        for prompt in PROMPTS
    ]  # fmt: skip
    assert got == expected
    stream = client.completions.create(
        model=model.id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in stream) == expected[0]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return value


def replica_group() -> dict:
    import ray

    (group,) = [
        g
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith("SERVE_REPLICA::llmctl#LLMServer#") and g["state"] == "CREATED"
    ]
    return group


def rank_pids() -> list[int]:
    import ray

    actors = ray._private.state.actors().values()  # the GCS's table; no dashboard here
    return sorted(a["Pid"] for a in actors if a["ActorClassName"] == "RayWorker"
                  and a["State"] == "ALIVE")  # fmt: skip


def test_ranks_are_actors_in_the_replicas_placement_group(deployed):
    import ray

    group = replica_group()
    # The manifest's bundles: the replica (1 CPU) with rank 0 in bundle 0, rank 1 in bundle 1.
    assert list(group["bundles"].values()) == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert group["strategy"] == "STRICT_PACK"
    assert len(rank_pids()) == 2
    # The proxy's health, which the RayService's worker pods are probed on.
    assert httpx.get(f"{deployed}/-/healthz", timeout=10).text == "success"
    # All 3 CPUs of the group are taken: the ranks did not take the 1 CPU outside it.
    key = f"CPU_group_{group['placement_group_id']}"
    wait_for(lambda: ray.available_resources().get(key, 0) == 0, 10, "the group's CPUs in use")
    assert ray.available_resources().get("CPU") == 1


def test_health_check_replaces_a_replica_whose_rank_died(deployed, expected):
    """SIGKILL one rank: the next request fails, the engine's health fails Ray Serve's check,
    and Ray Serve starts a new replica, which serves the same greedy text."""
    import openai
    from ray import serve

    client = openai.OpenAI(base_url=f"{deployed}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    old_group = replica_group()["placement_group_id"]
    os.kill(rank_pids()[0], signal.SIGKILL)  # a Ray worker process this test's Ray started
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS)
    assert "Ray worker rank" in str(info.value)

    def replaced() -> bool:
        status = serve.status().applications["llmctl"]
        (deployment,) = status.deployments.values()
        try:
            group = replica_group()["placement_group_id"]
        except ValueError:  # none, or the old and the new one
            return False
        return deployment.status == "HEALTHY" and group != old_group

    wait_for(replaced, 90, "a new healthy replica")
    assert httpx.get(f"{deployed}/health", timeout=10).json()["status"] == "ok"
    text = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    assert text == expected[0]
