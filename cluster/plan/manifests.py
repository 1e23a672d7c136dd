"""Kubernetes manifests from a Plan: pure builders of plain dicts; the CLI dumps them as YAML.

Three ways to run a plan's layout on Kubernetes:
  - `lws`: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), one group of `nodes` pods per
    replica, on the mp backend across nodes. The leader (pod 0) runs
        llmctl serve MODEL -tp T -pp P ... --nnodes N --node-rank 0
            --master-addr $(LWS_LEADER_ADDRESS) --master-port PORT --host 0.0.0.0 --port 8000
    and each worker the same with --node-rank $(LWS_WORKER_INDEX) --headless (Kubernetes expands
    $(VAR) from the env LWS injects into every container). One node: the leader alone, the plan's
    own backend. A Service selects the leaders. Across nodes every pod reads the cluster secret
    (LLMCTL_CLUSTER_SECRET, which the nodes prove when they join) from the Secret
    NAME-cluster-secret, which the manifests reference but do not hold: `kubectl create secret
    generic NAME-cluster-secret --from-literal=secret=...` makes it (`llmctl plan` prints how).
  - `raycluster`: a KubeRay RayCluster (ray.io/v1), a head pod and nodes-1 worker pods, on the
    ray backend. The head runs the `ray start` KubeRay generates ($KUBERAY_GEN_RAY_START_CMD,
    with the ray.io/overwrite-container-cmd annotation), waits for Ray, then runs `llmctl serve`;
    its ranks go wherever Ray places them, the head first, as with `llmctl serve -i`.
  - `rayservice` (or `kuberay`, what KubeRay's and vLLM's docs serve with): a KubeRay RayService
    (ray.io/v1), Ray Serve LLM style. Its serveConfigV2 deploys llmctl's Ray Serve application
    (engine/entrypoints/ray_serve_app.py) with the plan's engine options as `args:`, one deployment
    replica per data-parallel replica, each replica's resources as Ray Serve LLM asks them (one
    placement-group bundle per rank, the ranks on the ray backend); its rayClusterConfig is the
    RayCluster's spec with a pod per node of each replica, every pod running only `ray start`.
    Ray Serve's proxy serves the API on every pod (KubeRay's Service NAME-serve-svc); Ray Serve
    health-checks each replica's engine and replaces one whose /health fails.

Every pod gets the node's GPUs (`nvidia.com/gpu` limits = the plan's GPUs per node), /dev/shm as a
memory-backed emptyDir (NCCL and torch share memory through it), VLLM_HOST_IP from the pod's IP
and NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME set to the pod's interface, and the model read-only
(a hostPath or a PersistentVolumeClaim holding it, mounted at its directory). The serving
container has readiness and liveness probes on /health of the serving port, behind a startup
probe that gives the model time to load; a RayService's pods have KubeRay's own probes of Ray
and its Serve proxy, spelled as HTTP GETs (KubeRay's run wget, which the llmctl image does not
install). Every `llmctl serve` flag is spelled by engine_args_to_argv from the plan's EngineArgs
keywords.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

import yaml

from llmctl.cluster.errors import ConfigError
from llmctl.cluster.plan.kube_options import (
    DEFAULT_MASTER_PORT,
    KubeOptions,
)
from llmctl.engine.config.engine_args import EngineArgs, engine_args_to_argv
from llmctl.engine.config.options import SERVE, SERVER, option
from llmctl.engine.distributed.join import SECRET_ENV

GPU_RESOURCE = "nvidia.com/gpu"
CLUSTER_SECRET_KEY = "secret"  # the key of the cluster secret in its Kubernetes Secret
MODEL_VOLUME, SHM_VOLUME = "model", "dshm"
# The startup probe allows this long for loading the model before liveness takes over.
STARTUP_SECONDS = 3600
PROBE_PERIOD_S = 10
# The ray backend waits this long for Ray to place every rank (worker pods may still be pulling).
RAY_PLACEMENT_TIMEOUT_S = 1800
# The ports `ray start` gets from KubeRay: the dashboard (head) and each node's dashboard agent.
RAY_DASHBOARD_PORT, RAY_AGENT_PORT = 8265, 52365


@dataclass
class ServeCommandArgs(EngineArgs):
    """EngineArgs and the `llmctl serve` options a pod's command sets besides them: where the
    server listens (the mp backend's multi-node rendezvous flags are EngineArgs' own). Declared
    here so that engine_args_to_argv spells them as `llmctl serve` declares them."""

    host: str | None = option("Address to listen on.", default=None, panel=SERVER,
                              commands=(SERVE,))  # fmt: skip
    port: int | None = option("Port to listen on.", default=None, panel=SERVER, commands=(SERVE,))


def manifests(plan, opts: KubeOptions) -> list[dict]:
    """The objects to `kubectl apply`, in order."""
    if opts.kind == "lws":
        return [leader_worker_set(plan, opts), leader_service(opts)]
    if opts.kind == "raycluster":
        return [ray_cluster(plan, opts)]
    return [ray_service(plan, opts)]


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # a manifest spells every value out, no &id001
        return True


def _str(dumper: yaml.SafeDumper, text: str):
    """A multi-line string (a RayService's serveConfigV2) as a literal block, readable YAML."""
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objects: list[dict]) -> str:
    """The objects as one YAML stream, `---` between them, in the builders' key order."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=100)


# -- the serve command ---------------------------------------------------------------------------


def serve_argv(plan, opts: KubeOptions, backend: str | None, **serve: object) -> list[str]:
    """`llmctl serve MODEL` with the plan's engine options on `backend`, plus `serve`:
    ServeCommandArgs keywords (host, port, nnodes, node_rank, master_addr, headless, ...)."""
    args = {k: v for k, v in plan.serve_args.items() if v is not None}
    if plan.gpus_used > 1:
        args["distributed_executor_backend"] = backend
    args.update({k: v for k, v in serve.items() if v is not None})
    model = [opts.model_path] if opts.model_path else []
    return ["llmctl", "serve", *model, *engine_args_to_argv(args, ServeCommandArgs, aliases=True)]


def gpus_per_pod(plan) -> int:
    """The plan's GPUs on each node (0 on the CPU)."""
    if plan.device != "cuda":
        return 0
    if plan.gpus_used % plan.nodes_used:
        raise ConfigError(
            f"{plan.gpus_used} ranks do not split evenly over {plan.nodes_used} nodes",
            "choose -tp x -pp as a multiple of the nodes (tp = GPUs per node, pp = nodes)",
        )
    return plan.gpus_used // plan.nodes_used


# -- pods ----------------------------------------------------------------------------------------


def env(
    opts: KubeOptions, extra: dict[str, str] | None = None, *, joins: bool = False
) -> list[dict]:
    """The node's address and interfaces, as `cluster up` gives its containers; with `joins`
    (pods that join each other: an lws group across nodes), the cluster secret they prove when
    they join, from the Secret cluster_secret_name(opts) (never in the manifest itself)."""
    variables = [
        {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NCCL_SOCKET_IFNAME", "value": opts.socket_ifname},
        {"name": "GLOO_SOCKET_IFNAME", "value": opts.socket_ifname},
    ]
    if joins:
        ref = {"name": cluster_secret_name(opts), "key": CLUSTER_SECRET_KEY}
        variables.append({"name": SECRET_ENV, "valueFrom": {"secretKeyRef": ref}})
    return variables + [{"name": k, "value": v} for k, v in (extra or {}).items()]


def cluster_secret_name(opts: KubeOptions) -> str:
    """The Kubernetes Secret holding the cluster secret of an lws group across nodes."""
    return f"{opts.name}-cluster-secret"


def joins_nodes(plan, opts: KubeOptions) -> bool:
    """The manifests run a group whose pods join each other (and read the cluster secret)."""
    return opts.kind == "lws" and plan.nodes_used > 1


def cluster_secret_command(opts: KubeOptions) -> str:
    """The shell line that makes that Secret with a new random value (it is never in a file):
    a line for a person's shell, whose $(...) makes the value."""
    namespace = f" --namespace {shlex.quote(opts.namespace)}" if opts.namespace else ""
    return (
        f"kubectl create secret generic {shlex.quote(cluster_secret_name(opts))}{namespace} "
        f"--from-literal={CLUSTER_SECRET_KEY}=\"$(python3 -c 'import secrets; "
        "print(secrets.token_hex(32))')\""
    )


def health_probes(opts: KubeOptions) -> dict:
    """Startup (the model loads), then readiness and liveness on GET /health: 503 once the
    engine died, so Kubernetes stops routing to the pod and restarts it."""
    get = {"httpGet": {"path": "/health", "port": opts.port}, "periodSeconds": PROBE_PERIOD_S}
    return {
        "startupProbe": {**get, "failureThreshold": STARTUP_SECONDS // PROBE_PERIOD_S},
        "readinessProbe": {**get, "failureThreshold": 1},
        "livenessProbe": {**get, "failureThreshold": 3},
    }


def container(
    name: str,
    plan,
    opts: KubeOptions,
    *,
    command: list[str],
    args: list[str] | None = None,
    serving: bool,
    extra_env: dict[str, str] | None = None,
    ports: list[dict] | None = None,
    probes: dict | None = None,
    joins: bool = False,
) -> dict:
    spec: dict = {"name": name, "image": opts.image, "command": command}
    if args is not None:
        spec["args"] = args
    spec["env"] = env(opts, extra_env, joins=joins)
    if serving:
        spec["ports"] = [{"name": "http", "containerPort": opts.port, "protocol": "TCP"}]
        spec.update(health_probes(opts))
    elif ports:
        spec["ports"] = ports
    spec.update(probes or {})
    gpus = gpus_per_pod(plan)
    if gpus:
        spec["resources"] = {"limits": {GPU_RESOURCE: gpus}}
    mounts = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if opts.model_path and (opts.model_host_path or opts.model_pvc):
        model_dir = posixpath.dirname(opts.model_path)
        mounts.append({"name": MODEL_VOLUME, "mountPath": model_dir, "readOnly": True})
    spec["volumeMounts"] = mounts
    return spec


def volumes(opts: KubeOptions) -> list[dict]:
    shm = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}
    if opts.model_host_path:
        source = {"hostPath": {"path": opts.model_host_path, "type": "Directory"}}
    elif opts.model_pvc:
        source = {"persistentVolumeClaim": {"claimName": opts.model_pvc, "readOnly": True}}
    else:
        return [shm]
    return [shm, {"name": MODEL_VOLUME, **source}]


def pod_template(containers: list[dict], opts: KubeOptions, labels: dict | None = None) -> dict:
    metadata = {"labels": {"app": opts.name, **(labels or {})}}
    return {"metadata": metadata, "spec": {"containers": containers, "volumes": volumes(opts)}}


def _metadata(opts: KubeOptions) -> dict:
    meta: dict = {"name": opts.name, "labels": {"app": opts.name}}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return meta


# -- LeaderWorkerSet -----------------------------------------------------------------------------


def leader_worker_set(plan, opts: KubeOptions) -> dict:
    """One group of plan.nodes_used pods: the leader serves, the workers run their ranks."""
    nodes = plan.nodes_used
    pp = plan.pipeline_parallel_size
    if nodes > 1 and pp % nodes:
        raise ConfigError(
            f"tp={plan.tensor_parallel_size} x pp={pp} on {nodes} nodes: the mp backend runs "
            "whole pipeline stages on each node, and pp does not divide over the nodes",
            f"use a -pp divisible by {nodes} (tp = GPUs per node, pp = nodes), or --emit "
            "raycluster (Ray places any layout)",
        )
    listen = {"host": "0.0.0.0", "port": opts.port}
    if nodes == 1:
        leader_argv = serve_argv(plan, opts, plan.distributed_executor_backend, **listen)
    else:
        rendezvous = {
            "nnodes": nodes,
            "master_addr": "$(LWS_LEADER_ADDRESS)",
            "master_port": opts.master_port or DEFAULT_MASTER_PORT,
        }
        leader_argv = serve_argv(plan, opts, "mp", **rendezvous, node_rank="0", **listen)
        worker_argv = serve_argv(
            plan, opts, "mp", **rendezvous, node_rank="$(LWS_WORKER_INDEX)", headless=True
        )
    joins = joins_nodes(plan, opts)  # the workers join the leader: both prove the secret
    leader = pod_template(
        [container("llmctl", plan, opts, command=leader_argv, serving=True, joins=joins)],
        opts,
        {"role": "leader"},
    )
    template: dict = {"size": nodes, "restartPolicy": "RecreateGroupOnPodRestart"}
    if nodes == 1:
        template["workerTemplate"] = leader  # a group of one: the leader's template
    else:
        template["leaderTemplate"] = leader
        template["workerTemplate"] = pod_template(
            [container("llmctl", plan, opts, command=worker_argv, serving=False, joins=True)],
            opts,
            {"role": "worker"},
        )
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(opts),
        "spec": {
            "replicas": 1,
            # The workers start with the leader pod, not once it is ready: it is ready only
            # after every node's ranks joined it.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": template,
        },
    }


def leader_service(opts: KubeOptions) -> dict:
    """The OpenAI API of the leaders (the pods that listen)."""
    meta = _metadata(opts)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "selector": {"leaderworkerset.sigs.k8s.io/name": opts.name, "role": "leader"},
            "ports": [
                {"name": "http", "port": opts.port, "targetPort": opts.port, "protocol": "TCP"}
            ],  # fmt: skip
        },
    }


# -- KubeRay RayCluster --------------------------------------------------------------------------


def head_script(serve: list[str]) -> str:
    """The head container's shell: KubeRay's `ray start` (it blocks) in the background, then
    `llmctl serve` once Ray answers; the container lives as long as the server, and exits if
    `ray start` does before Ray answers. KubeRay writes the command for a shell (its
    --resources='{...}' is quoted): eval, not word splitting."""
    return (
        'ulimit -n 65536; eval "$KUBERAY_GEN_RAY_START_CMD" & ray_start=$!; '
        "until ray status >/dev/null 2>&1; do kill -0 $ray_start || exit 1; sleep 1; done; "
        "exec " + shlex.join(serve)
    )


# Not a login shell (-l, as KubeRay's examples): Debian's /etc/profile resets PATH, which loses
# the image's /opt/llmctl/bin (templates/Dockerfile).
_SHELL = ["/bin/bash", "-c", "--"]
# KubeRay copies it to the pods: their command is ours, its `ray start` in an env variable.
_OVERWRITE = {"ray.io/overwrite-container-cmd": "true"}
_RAY_START = 'ulimit -n 65536; eval "exec $KUBERAY_GEN_RAY_START_CMD"'


def ray_cluster(plan, opts: KubeOptions) -> dict:
    """A head and nodes-1 workers; the head serves on the ray backend (every node's GPUs)."""
    serve = serve_argv(plan, opts, "ray", host="0.0.0.0", port=opts.port)
    timeout = {"LLMCTL_RAY_PLACEMENT_TIMEOUT": str(RAY_PLACEMENT_TIMEOUT_S)}
    head = container("ray-head", plan, opts, command=_SHELL, args=[head_script(serve)],
                     serving=True, extra_env=timeout)  # fmt: skip
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {**_metadata(opts), "annotations": dict(_OVERWRITE)},
        "spec": ray_cluster_spec(plan, opts, head, plan.nodes_used),
    }


def ray_cluster_spec(
    plan,
    opts: KubeOptions,
    head: dict,
    pods: int,
    worker_ports: list[dict] | None = None,
    worker_probes: dict | None = None,
) -> dict:
    """The head pod running `head`, and pods-1 workers running `ray start` alone; every pod
    has the GPUs of one node of the plan."""
    spec: dict = {"headGroupSpec": {"rayStartParams": {}, "template": pod_template([head], opts)}}
    if opts.ray_version:
        spec = {"rayVersion": opts.ray_version, **spec}
    if pods > 1:
        worker = container("ray-worker", plan, opts, command=_SHELL, args=[_RAY_START],
                           serving=False, ports=worker_ports, probes=worker_probes)  # fmt: skip
        spec["workerGroupSpecs"] = [
            {
                "groupName": "gpu" if plan.device == "cuda" else "cpu",
                "replicas": pods - 1,
                "minReplicas": pods - 1,
                "maxReplicas": pods - 1,
                "rayStartParams": {},
                "template": pod_template([worker], opts),
            }
        ]
    return spec


# -- KubeRay RayService --------------------------------------------------------------------------


def serve_app_args(plan, opts: KubeOptions) -> dict:
    """The Ray Serve application's `args:`: the plan's EngineArgs keywords for one replica, the
    model's path in the pod, and the ray backend when the replica has several ranks."""
    args = {k: v for k, v in plan.serve_args.items() if v is not None}
    args.pop("distributed_executor_backend", None)
    if plan.gpus_used > 1:
        args["distributed_executor_backend"] = "ray"  # the ranks in the replica's bundles
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()}
    return {"model": opts.model_path, **args} if opts.model_path else args


def serve_config(plan, opts: KubeOptions) -> dict:
    """serveConfigV2: llmctl's application, num_replicas = the plan's data-parallel replicas,
    each replica's resources those of its tp x pp ranks (ray_serve_app.deployment_options)."""
    from llmctl.engine.entrypoints import ray_serve_app

    options = ray_serve_app.deployment_options(
        plan.tensor_parallel_size, plan.pipeline_parallel_size, gpu=plan.device == "cuda"
    )
    deployment = {
        "name": ray_serve_app.DEPLOYMENT_NAME,
        "num_replicas": plan.data_parallel_size,
        **options,
    }
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": opts.port},
        "applications": [
            {
                "name": "llmctl",
                "route_prefix": "/",
                "import_path": ray_serve_app.IMPORT_PATH,
                "args": serve_app_args(plan, opts),
                "deployments": [deployment],
            }
        ],
    }


def ray_probes(opts: KubeOptions, head: bool) -> dict:
    """KubeRay's probes of a RayService's pod (its defaults), as HTTP GETs: liveness, the node's
    raylet (through its dashboard agent); readiness, the GCS on the head (KubeRay routes to the
    head's proxy itself), Ray Serve's proxy on a worker (a node without replicas drains it)."""
    live = {"path": "/api/local_raylet_healthz", "port": RAY_AGENT_PORT}
    if head:
        ready = {"path": "/api/gcs_healthz", "port": RAY_DASHBOARD_PORT}
    else:
        ready = {"path": "/-/healthz", "port": opts.port}
    return {
        "readinessProbe": {"httpGet": ready, "initialDelaySeconds": 10, "periodSeconds": 5,
                           "timeoutSeconds": 5, "failureThreshold": 10 if head else 1},
        "livenessProbe": {"httpGet": live, "initialDelaySeconds": 30, "periodSeconds": 5,
                          "timeoutSeconds": 5, "failureThreshold": 120},
    }  # fmt: skip


def ray_service(plan, opts: KubeOptions) -> dict:
    """Ray Serve's application on a RayCluster of a pod per node of each data-parallel replica
    (the plan's GPUs per node in each), every pod running `ray start` and Ray Serve's proxy."""
    config = yaml.dump(serve_config(plan, opts), Dumper=_Dumper, sort_keys=False, width=100)
    serve_port = [{"name": "serve", "containerPort": opts.port, "protocol": "TCP"}]
    head = container("ray-head", plan, opts, command=_SHELL, args=[_RAY_START], serving=False,
                     ports=serve_port, probes=ray_probes(opts, head=True))  # fmt: skip
    pods = plan.data_parallel_size * plan.nodes_used
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        # KubeRay copies a RayService's annotations to the RayCluster it creates.
        "metadata": {**_metadata(opts), "annotations": dict(_OVERWRITE)},
        "spec": {
            "serveConfigV2": config,
            "rayClusterConfig": ray_cluster_spec(
                plan, opts, head, pods, serve_port, ray_probes(opts, head=False)
            ),
        },
    }
