"""Kubernetes manifests from a plan (cluster/plan/manifests.py), validated against the real CRDs.

Three layouts as `llmctl plan` decides them on 80 GiB GPUs: Llama-3.1-8B on one GPU,
Llama-3.1-70B at tp=8 on one node, Llama-3.1-405B at tp=8 x pp=2 on two nodes. Each manifest
must pass the LeaderWorkerSet, RayCluster or RayService CRD's schema (tests/k8s_schemas.py:
strict, as kubectl apply; a RayService's serveConfigV2 against Ray Serve's schema) and carry what
the plan decided: the layout in `llmctl serve`'s flags (or the Ray Serve application's args), the
nodes and replicas as pods, the GPUs per pod, the env, the probes and the model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest
import yaml
from k8s_schemas import errors

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.kube_options import KubeOptions, kube_options
from llmctl.cluster.plan.manifests import manifests, serve_argv, to_yaml
from llmctl.cluster.plan.model_spec import load_model_spec
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine.entrypoints.ray_serve_app import split_args
from llmctl.engine.errors import ConfigError

LAYOUTS = {
    # name: (model, nodes, plan options, (tp, pp, nodes, GPUs per pod))
    "1gpu": ("Llama-3.1-8B", 1, {}, (1, 1, 1, 1)),
    "tp8": ("Llama-3.1-70B", 1, {"tensor_parallel_size": 8}, (8, 1, 1, 8)),
    "tp8xpp2": ("Llama-3.1-405B", 2, {"max_model_len": 8192}, (8, 2, 2, 8)),
}


def plan_for(layout: str):
    model, nodes, options, _ = LAYOUTS[layout]
    return make_plan(
        load_model_spec(model), inventory_from_flags(nodes, 8, 80.0, "nvlink"),
        PlanOptions(**options),
    )  # fmt: skip


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def pod_spec(template: dict) -> dict:
    return template["spec"]


def the_container(template: dict) -> dict:
    (container,) = pod_spec(template)["containers"]
    return container


def check_pod(template: dict, plan, gpus: int, model_dir: str) -> dict:
    """What every pod carries: GPUs, /dev/shm in memory, the interfaces, the model read-only."""
    container = the_container(template)
    if gpus:
        assert container["resources"]["limits"] == {"nvidia.com/gpu": gpus}
    env = {e["name"]: e for e in container["env"]}
    assert env["VLLM_HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["NCCL_SOCKET_IFNAME"]["value"] == env["GLOO_SOCKET_IFNAME"]["value"] == "eth0"
    volumes = {v["name"]: v for v in pod_spec(template)["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "10Gi"}
    model = mounts[model_dir]
    assert model["readOnly"] is True
    assert volumes[model["name"]]["hostPath"] == {"path": model_dir, "type": "Directory"}
    return container


def check_probes(container: dict, port: int) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port}
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_leader_worker_set_carries_the_plan(layout):
    plan = plan_for(layout)
    tp, pp, nodes, gpus = LAYOUTS[layout][3]
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.nodes_used) == (
        tp, pp, nodes,
    )  # fmt: skip
    model = LAYOUTS[layout][0]
    opts = kube_options("lws", model)
    objects = manifests(plan, opts)
    assert [o["kind"] for o in objects] == ["LeaderWorkerSet", "Service"]
    for obj in objects:
        assert errors(obj) == [], obj["kind"]
    lws, service = objects
    assert lws["metadata"]["name"] == opts.name == f"llmctl-{model.lower().replace('.', '-')}"
    assert lws["spec"]["replicas"] == 1
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == nodes
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader_template = group.get("leaderTemplate", group["workerTemplate"])
    leader = check_pod(leader_template, plan, gpus, "/models")
    check_probes(leader, 8000)
    argv = leader["command"]
    assert argv[:3] == ["llmctl", "serve", f"/models/{model}"]
    assert flag(argv, "-tp") == (str(tp) if tp > 1 else None)
    assert flag(argv, "-pp") == (str(pp) if pp > 1 else None)
    assert flag(argv, "--host") == "0.0.0.0" and flag(argv, "--port") == "8000"
    assert service["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": opts.name, "role": "leader",
    }  # fmt: skip
    assert service["spec"]["ports"][0]["port"] == 8000
    if nodes == 1:
        assert "leaderTemplate" not in group and "--nnodes" not in argv
        backend = None if tp * pp == 1 else "mp"
        assert flag(argv, "--distributed-executor-backend") == backend
        return
    # Across nodes: the mp backend, the leader's rendezvous, and the workers' ranks.
    worker = check_pod(group["workerTemplate"], plan, gpus, "/models")
    assert "readinessProbe" not in worker and "ports" not in worker
    wargv = worker["command"]
    for command in (argv, wargv):
        assert flag(command, "--distributed-executor-backend") == "mp"
        assert flag(command, "--nnodes") == str(nodes)
        assert flag(command, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(command, "--master-port") == "29501"
        assert flag(command, "--max-model-len") == "8192"  # the plan's engine options too
    assert flag(argv, "--node-rank") == "0" and "--headless" not in argv
    assert flag(wargv, "--node-rank") == "$(LWS_WORKER_INDEX)" and "--headless" in wargv
    assert "--port" not in wargv
    # The same command otherwise: the workers run the leader's ranks' layout.
    same = [a for a in argv if a not in ("--host", "0.0.0.0", "--port", "8000", "0")]
    assert same == [a for a in wargv if a not in ("$(LWS_WORKER_INDEX)", "--headless")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ray_cluster_carries_the_plan(layout):
    plan = plan_for(layout)
    tp, pp, nodes, gpus = LAYOUTS[layout][3]
    model = LAYOUTS[layout][0]
    opts = kube_options("raycluster", model, model_pvc="models", ray_version="2.60.0")
    (cluster,) = manifests(plan, opts)
    assert errors(cluster) == []
    assert cluster["metadata"]["annotations"] == {"ray.io/overwrite-container-cmd": "true"}
    assert cluster["spec"]["rayVersion"] == "2.60.0"
    head_template = cluster["spec"]["headGroupSpec"]["template"]
    head = the_container(head_template)
    assert head["resources"]["limits"] == {"nvidia.com/gpu": gpus}
    volumes = {v["name"]: v for v in pod_spec(head_template)["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    check_probes(head, 8000)
    (script,) = head["args"]
    assert script.startswith('ulimit -n 65536; eval "$KUBERAY_GEN_RAY_START_CMD" & ray_start=$!; ')
    serve = serve_argv(plan, opts, "ray", host="0.0.0.0", port=8000)
    assert script.endswith("; exec " + " ".join(serve))
    assert flag(serve, "-tp") == (str(tp) if tp > 1 else None)
    assert flag(serve, "-pp") == (str(pp) if pp > 1 else None)
    assert flag(serve, "--distributed-executor-backend") == (None if tp * pp == 1 else "ray")
    groups = cluster["spec"].get("workerGroupSpecs", [])
    if nodes == 1:
        assert groups == []
        return
    (group,) = groups
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == nodes - 1
    worker = the_container(group["template"])
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": gpus}
    assert worker["args"] == ['ulimit -n 65536; eval "exec $KUBERAY_GEN_RAY_START_CMD"']


def serve_app(service: dict) -> tuple[dict, dict, dict]:
    """A RayService's serveConfigV2: (the config, its one application, its one deployment)."""
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    (deployment,) = app["deployments"]
    return config, app, deployment


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ray_service_carries_the_plan(layout):
    plan = plan_for(layout)
    tp, pp, nodes, gpus = LAYOUTS[layout][3]
    model = LAYOUTS[layout][0]
    opts = kube_options("rayservice", model, ray_version="2.60.0")
    (service,) = manifests(plan, opts)
    assert errors(service) == []
    assert service["metadata"]["name"] == opts.name
    # KubeRay copies it to the RayCluster: the pods run our `ray start` line, not a login shell.
    assert service["metadata"]["annotations"] == {"ray.io/overwrite-container-cmd": "true"}
    config, app, deployment = serve_app(service)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert app["import_path"] == "llmctl.engine.entrypoints.ray_serve_app:build_app"
    assert app["route_prefix"] == "/"
    # The application's args: the plan's engine options, as the replica's EngineArgs take them.
    args = app["args"]
    assert args["model"] == f"/models/{model}"
    assert args.get("tensor_parallel_size", 1) == tp
    assert args.get("pipeline_parallel_size", 1) == pp
    assert args.get("distributed_executor_backend") == (None if tp * pp == 1 else "ray")
    assert args.get("max_model_len") == plan.serve_args.get("max_model_len")
    engine, server = split_args(args)
    assert engine == args and server == {}
    # One deployment replica per data-parallel replica (8B fits one of the node's 8 GPUs: the
    # plan proposes 8), each with its ranks' resources.
    dp = plan.data_parallel_size
    assert dp == {"1gpu": 8, "tp8": 1, "tp8xpp2": 1}[layout]
    assert deployment["name"] == "LLMServer"
    assert deployment["num_replicas"] == dp
    if tp * pp == 1:
        assert deployment["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
        assert "placement_group_bundles" not in deployment
    else:
        assert deployment["ray_actor_options"] == {"num_cpus": 1}
        bundles = deployment["placement_group_bundles"]
        assert bundles == [{"CPU": 1, "GPU": 1}] + [{"GPU": 1}] * (tp * pp - 1)
        assert deployment["placement_group_strategy"] == ("STRICT_PACK" if pp == 1 else "PACK")
    # The cluster: a pod per node of each replica, each with a node's GPUs, all running Ray.
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    templates = [cluster["headGroupSpec"]["template"]]
    groups = cluster.get("workerGroupSpecs", [])
    if dp * nodes == 1:
        assert groups == []
    else:
        (group,) = groups
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == dp * nodes - 1
        templates.append(group["template"])
    assert gpus * dp * nodes == dp * tp * pp  # a GPU for every rank of every replica
    for template in templates:
        container = check_pod(template, plan, gpus, "/models")
        assert container["command"] == ["/bin/bash", "-c", "--"]
        assert container["args"] == ['ulimit -n 65536; eval "exec $KUBERAY_GEN_RAY_START_CMD"']
        assert container["ports"] == [{"name": "serve", "containerPort": 8000, "protocol": "TCP"}]
        # KubeRay's own probes as HTTP GETs: the raylet; the GCS on the head, Serve's proxy on
        # the workers (KubeRay's wget would fail in the llmctl image).
        live = {"path": "/api/local_raylet_healthz", "port": 52365}
        assert container["livenessProbe"]["httpGet"] == live
    head = the_container(templates[0])
    assert head["readinessProbe"]["httpGet"] == {"path": "/api/gcs_healthz", "port": 8265}
    for template in templates[1:]:
        worker = the_container(template)
        assert worker["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": 8000}


def test_ray_service_of_replicas_and_of_a_cpu_plan():
    """-dp 2 of tp=4: two replicas, two pods of 4 GPUs; on the CPU, bundles of CPUs and no
    GPU; kuberay is the RayService; the serveConfigV2 is a readable YAML block."""
    plan = make_plan(
        load_model_spec("Llama-3.1-70B"), inventory_from_flags(1, 8, 80.0, "nvlink"),
        PlanOptions(tensor_parallel_size=4, data_parallel_size=2, max_model_len=4096),
    )  # fmt: skip
    (service,) = manifests(plan, kube_options("kuberay", "Llama-3.1-70B", port=9000))
    assert service["kind"] == "RayService" and errors(service) == []
    config, app, deployment = serve_app(service)
    assert deployment["num_replicas"] == 2 and "data_parallel_size" not in app["args"]
    assert app["args"]["max_model_len"] == 4096
    assert len(deployment["placement_group_bundles"]) == 4
    assert config["http_options"]["port"] == 9000
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["replicas"] == 1
    assert the_container(group["template"])["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert the_container(group["template"])["ports"][0]["containerPort"] == 9000
    assert "serveConfigV2: |\n    proxy_location: EveryNode\n" in to_yaml([service])

    cpu = make_plan(
        load_model_spec("Llama-3.1-8B"), inventory_from_flags(1, 8, 80.0, "nvlink"),
        PlanOptions(device="cpu", tensor_parallel_size=2, kv_cache_space_gib=4, max_model_len=8192),
    )  # fmt: skip
    (service,) = manifests(cpu, kube_options("rayservice", "Llama-3.1-8B"))
    assert errors(service) == []
    _, app, deployment = serve_app(service)
    assert deployment["placement_group_bundles"] == [{"CPU": 2}, {"CPU": 1}]
    assert app["args"]["device"] == "cpu" and app["args"]["kv_cache_space_gib"] == 4
    head = the_container(service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    assert "resources" not in head


def test_serve_config_check_refuses_what_ray_serve_would():
    """The serveConfigV2 check can fail: a misspelt deployment option, a bad replica count."""
    (service,) = manifests(plan_for("tp8"), kube_options("rayservice", "Llama-3.1-70B"))
    config, app, deployment = serve_app(service)
    deployment["num_replica"] = 2
    deployment["ray_actor_options"]["num_gpu"] = 1
    app["deployments"].append({"name": "x", "num_replicas": "two"})
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    found = errors(service)
    assert any("'num_replica' was unexpected" in e for e in found)
    assert any("'num_gpu' was unexpected" in e for e in found)
    assert any("num_replicas` must be an int" in e for e in found)


def test_the_schema_check_refuses_what_kubernetes_would():
    """The validation can fail: a misspelt field, a wrong type, a missing required field."""
    (cluster,) = manifests(plan_for("tp8"), kube_options("raycluster", "Llama-3.1-70B"))
    head = the_container(cluster["spec"]["headGroupSpec"]["template"])
    head["resources"] = {"limit": {"nvidia.com/gpu": 8}}
    head["readinessProbe"]["periodSeconds"] = "10"
    del cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["name"]
    found = errors(cluster)
    assert any("'limit' was unexpected" in e for e in found)
    assert any("periodSeconds" in e and "is not of type 'integer'" in e for e in found)
    assert any("'name' is a required property" in e for e in found)


def test_yaml_round_trips_without_aliases():
    objects = manifests(plan_for("tp8xpp2"), kube_options("lws", "Llama-3.1-405B"))
    text = to_yaml(objects)
    assert "&id" not in text and "*id" not in text
    assert list(yaml.safe_load_all(text)) == objects


def test_local_model_is_mounted_at_its_own_path(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    opts = kube_options("lws", str(model))
    assert opts.model_path == str(model) and opts.model_host_path == str(tmp_path)
    assert opts.name == "llmctl-my-model"
    bundled = kube_options("lws", None)  # the image's own SmolLM2: no volume, no MODEL
    (lws, _) = manifests(plan_for("1gpu"), bundled)
    container = the_container(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    assert container["command"][:3] == ["llmctl", "serve", "--host"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/dev/shm"]


@pytest.mark.parametrize(
    "kind, given, message, hint",
    [
        ("lws", {"ray_version": "2.60.0"}, "--ray-version applies to --emit raycluster",
         "drop --ray-version, or use --emit raycluster"),
        ("raycluster", {"master_port": 1234}, "--master-port applies to --emit lws",
         "drop --master-port, or use --emit lws"),
        ("rayservice", {"master_port": 1234}, "--master-port applies to --emit lws",
         "drop --master-port, or use --emit lws"),
        ("helm", {}, "unknown --emit kind 'helm'", "use --emit lws"),
        ("lws", {"name": "Llama_70B"}, "--name 'Llama_70B' is not a Kubernetes name",
         "lower-case letters"),
        ("lws", {"model_host_path": "/data", "model_pvc": "models"},
         "--model-host-path and --model-pvc both", "keep one"),
        ("lws", {"model_path": "models/x"}, "is not an absolute path", "/models/"),
        ("lws", {"model_path": "/llama"}, "is at the root", "--model-path /models/llama"),
        ("lws", {"port": 70000}, "--port 70000 is not a port", "1-65535"),
    ],
)  # fmt: skip
def test_bad_options_name_the_fix(kind, given, message, hint):
    with pytest.raises(ConfigError) as info:
        kube_options(kind, "Llama-3.1-70B", **given)
    assert message in info.value.message
    assert hint in info.value.hint


def test_ranks_that_do_not_split_over_the_nodes_are_refused():
    plan = make_plan(
        load_model_spec("Llama-3.1-70B"), inventory_from_flags(2, 8, 80.0, "nvlink"),
        PlanOptions(pipeline_parallel_size=9, max_model_len=8192),
    )  # fmt: skip
    assert (plan.gpus_used, plan.nodes_used) == (9, 2)
    with pytest.raises(ConfigError, match="9 ranks do not split evenly over 2 nodes"):
        manifests(plan, KubeOptions(kind="raycluster", name="x"))


def test_lws_refuses_nodes_that_would_split_a_stage():
    """The mp backend runs whole pipeline stages per node; Ray places any layout."""
    plan = make_plan(
        load_model_spec("Llama-3.1-70B"), inventory_from_flags(2, 8, 80.0, "nvlink"),
        PlanOptions(tensor_parallel_size=4, pipeline_parallel_size=3),
    )  # fmt: skip
    assert (plan.gpus_used, plan.nodes_used) == (12, 2)
    with pytest.raises(ConfigError) as info:
        manifests(plan, kube_options("lws", "Llama-3.1-70B"))
    assert "tp=4 x pp=3 on 2 nodes" in info.value.message
    assert "use a -pp divisible by 2" in info.value.hint and "--emit raycluster" in info.value.hint
    (cluster,) = manifests(plan, kube_options("raycluster", "Llama-3.1-70B"))
    assert errors(cluster) == []
    assert cluster["spec"]["workerGroupSpecs"][0]["replicas"] == 1


def _run_head_script(tmp_path, ray_start: str) -> subprocess.Popen:
    """The head's script in bash, with `ray` and `llmctl` stand-ins on PATH: `ray status`
    answers once `ready` exists; `llmctl` records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(f'#!/bin/sh\n[ "$1" = status ] && [ -e {tmp_path}/ready ]\n')
    (bin_dir / "llmctl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    (cluster,) = manifests(plan_for("1gpu"), kube_options("raycluster", "/models/my model"))
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    (script,) = head["args"]  # the pod's command, as its container runs it
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "KUBERAY_GEN_RAY_START_CMD": ray_start}  # fmt: skip
    process = subprocess.Popen([*head["command"], script], env=env,
                               start_new_session=True)  # fmt: skip
    try:
        process.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the background `ray start` stand-in
    return process


def test_head_script_serves_once_ray_answers(tmp_path):
    # `ray start --block` stand-in: Ray answers after a moment, and the process stays.
    process = _run_head_script(tmp_path, f"sh -c 'sleep 0.3; touch {tmp_path}/ready; sleep 30'")
    assert process.returncode == 0
    assert (tmp_path / "argv").read_text().splitlines() == [
        "serve", "/models/my model", "--host", "0.0.0.0", "--port", "8000",
    ]  # fmt: skip


def test_head_script_exits_when_ray_start_fails(tmp_path):
    process = _run_head_script(tmp_path, "false")
    assert process.returncode == 1
    assert not (tmp_path / "argv").exists()


def test_an_lws_group_across_nodes_reads_the_cluster_secret_from_a_secret():
    """Its pods join each other: each proves the cluster secret, which comes from a Kubernetes
    Secret the manifests name but do not hold; a group of one pod joins nothing."""
    from llmctl.cluster.plan.manifests import cluster_secret_command, joins_nodes

    opts = kube_options("lws", "Llama-3.1-405B", namespace="llm")
    lws, _ = manifests(plan_for("tp8xpp2"), opts)
    group = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        env = {e["name"]: e for e in the_container(group[role])["env"]}
        assert env["LLMCTL_CLUSTER_SECRET"] == {
            "name": "LLMCTL_CLUSTER_SECRET",
            "valueFrom": {"secretKeyRef": {"name": f"{opts.name}-cluster-secret", "key": "secret"}},
        }
    assert "secrets.token_hex" not in to_yaml([lws])  # a reference, no value
    assert errors(lws) == []
    command = cluster_secret_command(opts)
    assert command.startswith(
        f"kubectl create secret generic {opts.name}-cluster-secret --namespace llm "
        '--from-literal=secret="$(python3 -c '
    )
    single = kube_options("lws", "Llama-3.1-8B")
    assert not joins_nodes(plan_for("1gpu"), single)
    (alone, _) = manifests(plan_for("1gpu"), single)
    env = the_container(alone["spec"]["leaderWorkerTemplate"]["workerTemplate"])["env"]
    assert "LLMCTL_CLUSTER_SECRET" not in {e["name"] for e in env}
