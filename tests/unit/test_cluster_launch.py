"""Pure cluster code: the argv and env file of each node, idempotency hashes, parsers of captured
output, and preflight problems named per node. No SSH, no Docker (tests/e2e/cluster has those).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from llmctl.cluster.errors import (
    ConfigError,
    DockerUnavailableError,
    HostUnreachableError,
    ImageMissingError,
    ModelMismatchError,
    NodeNetworkError,
)
from llmctl.cluster.inventory import parse_inventory
from llmctl.cluster.launch.group_server import check_cluster_backend, exit_reason, group_record
from llmctl.cluster.launch.node_launch import NodeFacts, local_launch, node_launches
from llmctl.cluster.launch.parsers import (
    DockerInfo,
    model_fingerprint,
    parse_docker_info,
    parse_docker_inspect,
    parse_ip_addr,
    parse_listing,
    parse_ray_nodes,
    parse_ray_status,
    parse_sha256sum,
)
from llmctl.cluster.launch.preflight import probe_problems, public_ip_problems, raise_problems
from llmctl.cluster.launch.probe import NodeProbe
from llmctl.cluster.plan.node_commands import Layout, node_serve_argvs

DATA = Path(__file__).parent / "data"

INVENTORY = """\
name: demo
image: llmctl:latest
model: /models/smol
hf_home: /data/hf
env: {NCCL_IB_HCA: mlx5, HF_TOKEN: hf_secret}
nodes:
  - {host: n1, ip: 10.0.0.1, head: true, gpus: 2}
  - {host: n2, ip: 10.0.0.2, gpus: 2, env: {GLOO_SOCKET_IFNAME: ens5}}
"""

FACTS = {
    "n1": NodeFacts(ifname="eth0", image_id="sha256:aa", home="/root"),
    "n2": NodeFacts(ifname="eth1", image_id="sha256:aa", home="/home/u", hostname="gpu-b7"),
}


def launches(**kw):
    return node_launches(parse_inventory(INVENTORY), FACTS, **kw)


def test_head_and_worker_argv():
    head, worker = launches(secrets={"RAY_AUTH_TOKEN": "t0k"})
    argv = head.docker_run_argv()
    assert argv[:3] == ["docker", "run", "--detach"]
    assert argv[argv.index("--name") + 1] == "llmctl-demo"
    assert argv[argv.index("--network") + 1] == "host"
    assert argv[argv.index("--shm-size") + 1] == "10.24g"
    assert "/data/hf:/root/.cache/huggingface" in argv
    assert "/models/smol:/models/smol:ro" in argv
    assert argv[argv.index("--env-file") + 1] == "/root/.llmctl/demo-10.0.0.1.env"
    image_at = argv.index("llmctl:latest")
    assert argv[image_at + 1 :] == [
        "ray", "start", "--block", "--node-ip-address=10.0.0.1", "--disable-usage-stats",
        "--head", "--port=6379", "--num-gpus=2",
    ]  # fmt: skip
    wargv = worker.docker_run_argv()
    assert wargv[wargv.index("llmctl:latest") + 1 :] == [
        "ray", "start", "--block", "--node-ip-address=10.0.0.2", "--disable-usage-stats",
        "--address=10.0.0.1:6379", "--num-gpus=2",
    ]  # fmt: skip
    assert worker.env_file == "/home/u/.llmctl/demo-10.0.0.2.env"
    # Every node is in every container's /etc/hosts: no reverse lookup waits for a resolver.
    for launch in (head, worker):
        hosts = [launch.docker_run_argv()[i + 1] for i, a in enumerate(launch.docker_run_argv())
                 if a == "--add-host"]  # fmt: skip
        own = ["gpu-b7:10.0.0.2"] if launch is worker else []  # its own name, to its own IP
        assert hosts == ["n1:10.0.0.1", "n2:10.0.0.2", *own]
    assert "--gpus" not in argv  # no NVIDIA runtime probed


def test_no_value_reaches_the_command_line():
    """Env values, secrets above all, travel in the env file, never in argv (visible in ps)."""
    head, _ = launches(secrets={"RAY_AUTH_TOKEN": "t0k"})
    line = shlex.join(head.docker_run_argv())
    for value in ("hf_secret", "t0k", "mlx5"):
        assert value not in line
    assert head.printable_env()["HF_TOKEN"] == "***"
    assert head.printable_env()["RAY_AUTH_TOKEN"] == "***"
    assert "HF_TOKEN=hf_secret\n" in head.env_file_text()


def test_env_precedence_per_node():
    head, worker = launches()
    h, w = head.env_dict(), worker.env_dict()
    assert h["VLLM_HOST_IP"] == "10.0.0.1" and w["VLLM_HOST_IP"] == "10.0.0.2"
    assert h["NCCL_SOCKET_IFNAME"] == "eth0" and h["GLOO_SOCKET_IFNAME"] == "eth0"
    # n2's probed interface is eth1, but its own env names GLOO's: the inventory wins.
    assert w["NCCL_SOCKET_IFNAME"] == "eth1" and w["GLOO_SOCKET_IFNAME"] == "ens5"
    assert h["NCCL_IB_HCA"] == w["NCCL_IB_HCA"] == "mlx5"


def test_config_hash_is_stable_and_sees_changes():
    a, b = launches(secrets={"RAY_AUTH_TOKEN": "x"}), launches(secrets={"RAY_AUTH_TOKEN": "x"})
    assert a[0].config_hash == b[0].config_hash
    changed_token = launches(secrets={"RAY_AUTH_TOKEN": "y"})
    assert changed_token[0].config_hash != a[0].config_hash
    facts = dict(FACTS, n1=NodeFacts(ifname="eth0", image_id="sha256:bb", home="/root"))
    new_image = node_launches(parse_inventory(INVENTORY), facts, secrets={"RAY_AUTH_TOKEN": "x"})
    assert new_image[0].config_hash != a[0].config_hash
    assert new_image[1].config_hash == a[1].config_hash


def test_env_with_line_break_is_refused():
    text = INVENTORY.replace("mlx5", '"mlx5\\nEVIL=1"')
    with pytest.raises(ConfigError, match="NCCL_IB_HCA contains a line break"):
        node_launches(parse_inventory(text), FACTS)


def test_local_launch_is_the_run_cluster_layout():
    facts = NodeFacts(ifname="eth0", image_id="sha256:aa", nvidia_runtime=True, home="/root")
    launch = local_launch("worker", "10.0.0.2", "10.0.0.1", "img", facts, hf_home="/hf", gpus=None)
    argv = launch.docker_run_argv()
    assert argv[argv.index("--name") + 1] == "llmctl-ray-worker"
    assert argv[argv.index("--gpus") + 1] == "all"
    assert "--address=10.0.0.1:6379" in argv and "--node-ip-address=10.0.0.2" in argv
    assert not any(a.startswith("--num-gpus") for a in argv)  # Ray detects the GPUs


# -- parsers, on captured output --------------------------------------------------------------
def test_parse_ip_addr():
    addresses = parse_ip_addr((DATA / "ip_addr.txt").read_text())
    by_ip = {a.ip: a.ifname for a in addresses}
    assert by_ip["127.0.0.1"] == "lo" and by_ip["192.0.2.2"] == "eth0"
    veth = parse_ip_addr("7: eth0@if8    inet 10.77.0.12/24 brd 10.77.0.255 scope global eth0\\")
    assert veth[0].ifname == "eth0" and str(veth[0].interface.network) == "10.77.0.0/24"


def test_parse_ray_status_and_nodes():
    status = parse_ray_status((DATA / "ray_status_1node.txt").read_text())
    assert len(status.active_nodes) == 1 and status.gpus == 2.0 and status.totals["CPU"] == 2.0
    assert "memory" not in status.totals
    three = parse_ray_status((DATA / "ray_status_3nodes.txt").read_text())
    assert len(three.active_nodes) == 3 and three.gpus == 6.0
    nodes = parse_ray_nodes((DATA / "ray_list_nodes_1node.json").read_text())
    assert nodes[0].ip == "192.0.2.2" and nodes[0].is_head and nodes[0].alive
    assert nodes[0].gpus == 2.0


def test_parse_docker_outputs():
    info = parse_docker_info('20.10.24 {"io.containerd.runc.v2":{"path":"runc"},"nvidia":{}}')
    assert info.server_version == "20.10.24" and info.nvidia
    state = parse_docker_inspect(
        '[{"Name": "/llmctl-demo", "Image": "sha256:aa", "State": {"Status": "exited",'
        ' "Running": false, "ExitCode": 1}, "Config": {"Labels": {"llmctl.role": "head"}}}]'
    )
    assert state.name == "llmctl-demo" and not state.running and state.exit_code == 1
    assert state.labels == {"llmctl.role": "head"}
    assert parse_docker_inspect("[]") is None


def test_model_fingerprint():
    files = parse_listing("config.json\t700\nmodel.safetensors\t1000\n")
    digests = parse_sha256sum("ab12  /models/smol/config.json\n")
    base = model_fingerprint(files, digests)
    assert model_fingerprint(files, {"config.json": "ff"}) != base
    assert model_fingerprint(dict(files, **{"model.safetensors": 999}), digests) != base
    assert model_fingerprint(dict(files), dict(digests)) == base


# -- preflight --------------------------------------------------------------------------------
def probe(host: str, ip: str, **kw) -> NodeProbe:
    addresses = parse_ip_addr(f"2: eth0    inet {ip}/24 scope global eth0\\")
    defaults = dict(
        docker=DockerInfo("20.10", ()), image_id="sha256:aa", addresses=addresses,
        model_files={"config.json": 1}, model_fingerprint="f1",
    )  # fmt: skip
    return NodeProbe(host, **{**defaults, **kw})


def problems(probes, **kw):
    inv = parse_inventory(INVENTORY)
    options = dict(image="llmctl:latest", image_file=None, sync_model=False) | kw
    return probe_problems(inv, probes, **options)


def test_healthy_nodes_have_no_problem():
    assert problems({"n1": probe("n1", "10.0.0.1"), "n2": probe("n2", "10.0.0.2")}) == []


def test_each_problem_names_its_node_and_cause():
    probes = {
        "n1": probe("n1", "10.0.0.1", image_id=None),
        "n2": probe("n2", "10.0.0.2", model_files=None, model_fingerprint=None, docker=None),
    }
    found = problems(probes)
    kinds = {(p.host, p.kind) for p in found}
    assert kinds == {
        ("n1", ImageMissingError),
        ("n2", DockerUnavailableError),
        ("n2", ModelMismatchError),
    }
    with pytest.raises(ImageMissingError, match=r"3 problems, nothing was started") as info:
        raise_problems(found)
    assert "n2: the model /models/smol is missing" in info.value.message
    assert "--image-file" in info.value.hint and "--sync-model" in info.value.hint
    # --image-file and --sync-model make those two fixable.
    fixable = problems(probes, image_file="img.tar", sync_model=True)
    assert [p.kind for p in fixable] == [DockerUnavailableError]


def test_network_problems():
    probes = {"n1": probe("n1", "10.0.0.1"), "n2": probe("n2", "10.9.0.2")}
    (found,) = problems(probes)
    assert found.kind is NodeNetworkError and "10.0.0.2 is not an address of this node" in (
        found.message
    )
    other_net = parse_inventory(INVENTORY.replace("ip: 10.0.0.2", "ip: 10.9.0.2"))
    probes = {"n1": probe("n1", "10.0.0.1"), "n2": probe("n2", "10.9.0.2")}
    (found,) = probe_problems(other_net, probes, image="x", image_file=None, sync_model=False)
    assert found.host == "n2" and "not on the head's network 10.0.0.0/24" in found.message


def test_unreachable_node_and_differing_model():
    probes = {
        "n1": probe("n1", "10.0.0.1"),
        "n2": probe("n2", "10.0.0.2", model_files={"config.json": 2}, model_fingerprint="f2"),
    }
    (found,) = problems(probes)
    assert found.kind is ModelMismatchError and "differs from n1's" in found.message
    assert "config.json" in found.message
    down = NodeProbe("n2", error=HostUnreachableError("cannot reach root@n2:22: No route to host"))
    (found,) = problems({"n1": probe("n1", "10.0.0.1"), "n2": down})
    assert found.kind is HostUnreachableError and "No route to host" in found.message


def test_public_ip_is_refused_unless_allowed():
    inv = parse_inventory(INVENTORY.replace("10.0.0.2", "8.8.4.4"))
    (found,) = public_ip_problems(inv, allow_public_ip=False)
    assert found.host == "n2" and "public address" in found.message
    assert "--allow-public-ip" in found.hint
    assert public_ip_problems(inv, allow_public_ip=True) == []


def test_mp_launch_idles_and_ray_hashes_are_unchanged():
    head, worker = launches(backend="mp")
    argv = head.docker_run_argv()
    assert argv[argv.index("llmctl:latest") + 1 :] == ["sleep", "infinity"]
    assert "--init" in argv and "llmctl.backend=mp" in argv
    assert "VLLM_HOST_IP=10.0.0.1\n" in head.env_file_text()
    assert "NCCL_SOCKET_IFNAME=eth0\n" in head.env_file_text()
    assert "GLOO_SOCKET_IFNAME=ens5\n" in worker.env_file_text()  # the node's own env wins
    ray_head, _ = launches()
    assert head.config_hash != ray_hash(ray_head)
    # A Ray container started before `backend` existed keeps its hash (no needless recreate).
    assert ray_head.config_hash == ray_hash(ray_head)
    with pytest.raises(ConfigError, match="unknown backend 'slurm'"):
        launches(backend="slurm")


def ray_hash(launch) -> str:
    """The hash as computed before NodeLaunch had a `backend` field."""
    import hashlib
    import json

    fields = {k: v for k, v in launch.__dict__.items() if k not in ("env_file", "backend")}
    blob = json.dumps(fields, sort_keys=True, default=list).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def test_each_node_serves_its_part_of_the_mp_group():
    """The head serves the API as node 0; every other node runs its stages --headless, all with
    the same engine options and the head's address as the rendezvous."""
    inventory = parse_inventory(INVENTORY)
    layout = Layout(2, 2, "as given")
    record = group_record("/models/smol", layout, 8011, {"dtype": "float32"},
                          {"shutdown_timeout": 5.0}, inventory)  # fmt: skip
    common = [
        "llmctl", "serve", "/models/smol", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp",
        "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29501",
    ]  # fmt: skip
    assert list(record.argv) == common + [
        "--node-rank", "0", "--host", "0.0.0.0", "--port", "8011", "--shutdown-timeout", "5.0",
        "--dtype", "float32",
    ]  # fmt: skip
    assert record.workers == (
        ("n2", tuple(common + ["--node-rank", "1", "--headless", "--dtype", "float32"])),
    )
    assert record.backend == "mp" and record.endpoint("10.0.0.1") == "http://10.0.0.1:8011/v1"
    port = group_record("/m", layout, 8011, {"master_port": 4000}, None, inventory)
    assert "4000" in port.argv and "4000" in port.workers[0][1]
    three = node_serve_argvs("/m", Layout(1, 3, ""), 80, {}, None, head_ip="h", nnodes=3)
    assert [argv[argv.index("--node-rank") + 1] for argv in three] == ["0", "1", "2"]


def test_mp_layouts_must_run_whole_stages_per_node():
    inventory = parse_inventory(INVENTORY)
    with pytest.raises(ConfigError) as info:
        group_record("/m", Layout(4, 1, ""), 80, {}, None, inventory)
    assert "pipeline_parallel_size=1 (tp=4) does not divide among them" in info.value.message
    assert "pass -pp 2 (or a multiple of 2) and -tp 2" in info.value.hint
    with pytest.raises(ConfigError, match="puts 4 ranks on each of the 2 nodes"):
        group_record("/m", Layout(4, 2, ""), 80, {}, None, inventory)
    with pytest.raises(ConfigError, match="--nnodes, --master-addr: with -i"):
        group_record("/m", Layout(2, 2, ""), 80, {"nnodes": 2, "master_addr": "x"}, None,
                     inventory)  # fmt: skip


def test_serve_uses_the_backend_the_containers_run():
    assert check_cluster_backend(None, "mp", "c.yaml") == "mp"
    assert check_cluster_backend("mp", "mp", "c.yaml") == "mp"
    with pytest.raises(ConfigError) as info:
        check_cluster_backend("mp", "ray", "c.yaml")
    assert info.value.message == "the cluster's containers were started for the ray backend, not mp"
    assert info.value.hint.startswith("run llmctl cluster up -i c.yaml --backend mp first")
    assert check_cluster_backend("mp", "ray", "c.yaml", stop=True) == "ray"


def test_a_nodes_exit_reason_is_its_error_not_the_hint():
    log = (
        "INFO Node 1: joining node 0 at 10.0.0.1:29502 (global ranks 1, up to 10 s)\n"
        "error: node 1 could not reach node 0 at 10.0.0.1:29502 within 10 s\n"
        "hint: start node 0 (llmctl serve ... --nnodes 2 --node-rank 0 ...)\n"
    )
    assert exit_reason(log) == "node 1 could not reach node 0 at 10.0.0.1:29502 within 10 s"
    assert exit_reason("Traceback ...\nKilled\n\n") == "Killed"
    assert exit_reason("") == "(no output)"
