"""`cluster up` end to end over recording fake transports: probe -> diff -> act, without root,
SSH or Docker. Each node is a FakeTransport with a small Docker (tests/fake_transport.py); the
head also answers `ray status` and `ray list nodes` for the whole cluster.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from secrets import token_hex

import pytest
from fake_transport import FakeTransport, docker_node
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.cluster.errors import ClusterError, ConfigError, NodeNetworkError, RemoteCommandError
from llmctl.cluster.inventory import parse_inventory
from llmctl.cluster.launch import commands, launcher
from llmctl.cluster.launch.launch_report import Report
from llmctl.cluster.launch.launcher import Cluster
from llmctl.cluster.launch.local_node import down_local, up_this_node
from llmctl.cluster.launch.node_launch import NodeFacts, node_launches
from llmctl.cluster.launch.parsers import ContainerState
from llmctl.cluster.launch.up_diff import Create, Keep, Recreate, diff

DATA = Path(__file__).parent / "data"
MODEL = {"config.json": '{"hidden_size": 8}', "model.safetensors": "weights"}
INVENTORY = """\
name: demo
image: llmctl:latest
model: /models/smol
env: {NCCL_IB_HCA: mlx5}
nodes:
  - {host: n1, ip: 10.0.0.1, head: true, gpus: 2}
  - {host: n2, ip: 10.0.0.2, gpus: 2}
  - {host: n3, ip: 10.0.0.3, gpus: 2}
"""
TOKEN = "t0k" * 8
CONTAINER = "llmctl-demo"


@pytest.fixture(autouse=True)
def _fixed_token(monkeypatch):
    """A new cluster's Ray token and cluster secret, fixed so that an argv can be predicted."""
    monkeypatch.setattr(launcher.secrets, "token_hex", lambda n: TOKEN)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def nodes(text: str = INVENTORY) -> dict[str, FakeTransport]:
    inventory = parse_inventory(text)
    fakes = {n.host: docker_node(n.host, n.ip, model=MODEL) for n in inventory.nodes}
    ray = json.dumps([
        {"node_ip": n.ip, "is_head_node": n.head, "state": "ALIVE",
         "resources_total": {"GPU": float(n.gpus or 0)}}
        for n in inventory.nodes
    ])  # fmt: skip
    head = fakes[inventory.head.host]
    head.reply(
        rf"^docker exec {CONTAINER} ray status$", (DATA / "ray_status_3nodes.txt").read_text()
    )
    head.reply(rf"^docker exec {CONTAINER} ray list nodes", ray)
    return fakes


def up(fakes: dict[str, FakeTransport], text: str = INVENTORY, **kw) -> Report:
    with Cluster(parse_inventory(text), fakes, ray_wait_s=5.0) as cluster:
        return cluster.up(**kw)


def changes(fake: FakeTransport) -> list[list[str]]:
    """What changed the node: docker run/rm and files written."""
    return fake.ran(r"^(docker (run|rm|load) |'\(write\)' )")


def forget(fakes: dict[str, FakeTransport]) -> None:
    for fake in fakes.values():
        fake.calls.clear()


def test_second_up_changes_nothing():
    fakes = nodes()
    first = up(fakes)
    assert [r.action for r in first.rows] == ["created"] * 3 and first.changed
    assert first.ray is not None and first.ray.gpus == 6.0
    assert [r.ray_ip for r in first.rows] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    forget(fakes)
    second = up(fakes)
    assert [r.action for r in second.rows] == ["unchanged"] * 3 and not second.changed
    assert all(changes(f) == [] for f in fakes.values())
    assert second.commands == {}


def test_a_changed_node_is_recreated_alone():
    fakes = nodes()
    up(fakes)
    first_run = fakes["n3"].ran(r"^docker run ")[0]
    forget(fakes)
    changed = INVENTORY.replace(
        "{host: n3, ip: 10.0.0.3, gpus: 2}",
        "{host: n3, ip: 10.0.0.3, gpus: 2, env: {NCCL_DEBUG: INFO}}",
    )
    report = up(fakes, changed)
    assert [r.action for r in report.rows] == ["unchanged", "unchanged", "recreated"]
    assert changes(fakes["n1"]) == changes(fakes["n2"]) == []
    rm, write, run = changes(fakes["n3"])
    assert rm == ["docker", "rm", "--force", CONTAINER]
    assert write[1] == "/root/.llmctl/demo-10.0.0.3.env" and write[2] == "0o600"
    assert b"NCCL_DEBUG=INFO\n" in fakes["n3"].files[write[1]]
    assert run != first_run and run[:2] == ["docker", "run"]


def test_a_new_head_recreates_the_workers():
    fakes = nodes()
    up(fakes)
    fakes["n1"].containers.clear()  # the head's container is gone (docker rm by hand, a reboot)
    forget(fakes)
    report = up(fakes)
    assert [r.action for r in report.rows] == ["created", "recreated", "recreated"]
    assert [argv[:2] for argv in changes(fakes["n1"])] == [
        ["docker", "rm"],
        ["(write)", "/root/.llmctl/demo-10.0.0.1.env"],
        ["docker", "run"],
    ]
    for worker in ("n2", "n3"):
        assert [argv[0:2] for argv in changes(fakes[worker])][0] == ["docker", "rm"]
        assert fakes[worker].ran(r"^docker run ")


def test_dry_run_prints_the_exact_argv_per_node(monkeypatch, tmp_path):
    fakes = nodes()
    monkeypatch.setattr(launcher, "ssh_transports", lambda inventory: fakes)
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["cluster", "up", "-i", str(path), "--dry-run"],
        env={"COLUMNS": "200"},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert all(changes(f) == [] for f in fakes.values())  # nothing changed
    lines = result.stdout.splitlines()
    # The argv a real run would start, built the way the launcher builds it.
    facts = {
        host: NodeFacts(ifname="eth0", image_id="sha256:aa", home="/root", hostname=host)
        for host in fakes
    }
    secrets = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN, "LLMCTL_CLUSTER_SECRET": TOKEN}
    expected = node_launches(
        parse_inventory(INVENTORY), facts, secrets=secrets, image="llmctl:latest"
    )
    for launch in expected:
        at = lines.index(launch.host)
        assert lines[at + 1] == f"  {shlex.join(launch.docker_run_argv())}"
        assert "    RAY_AUTH_TOKEN=***" in lines[at + 2 : at + 20]
    rows = [line for line in lines if "would create" in line]
    assert [row.split()[1] for row in rows] == ["n1", "n2", "n3"]
    # And a real run runs exactly the argv printed.
    up(fakes)
    for launch in expected:
        assert fakes[launch.host].ran(r"^docker run ") == [launch.docker_run_argv()]


def test_a_failure_on_one_node_says_what_runs_where_and_how_to_remove_it():
    fakes = nodes()
    fakes["n3"].reply(
        r"^docker run ", (125, "", "docker: Error response from daemon: no space left on device.")
    )
    with pytest.raises(RemoteCommandError) as info:
        up(fakes)
    error = info.value
    assert (
        error.message
        == "docker run failed on n3: docker: Error response from daemon: no space left on device."
    )
    assert "containers started by this run: n1, n2;" in error.hint
    assert "`llmctl cluster down -i cluster.yaml` removes it" in error.hint
    assert fakes["n1"].containers and fakes["n2"].containers and not fakes["n3"].containers


def launch(host: str, ip: str):
    text = f"name: demo\nimage: i\nnodes:\n  - {{host: {host}, ip: {ip}, head: true, gpus: 1}}\n"
    (one,) = node_launches(parse_inventory(text), {host: NodeFacts("eth0", "sha256:aa")})
    return one


def state(launch, running: bool = True, config: str | None = None) -> ContainerState:
    labels = {commands.LABEL_CONFIG: config or launch.config_hash}
    return ContainerState(
        launch.container, "running" if running else "exited", running, 0, "", labels
    )


def test_diff_is_one_typed_action_per_node_with_its_reason():
    a, b, c = launch("n1", "10.0.0.1"), launch("n2", "10.0.0.2"), launch("n3", "10.0.0.3")
    actions = diff([a, b, c], {"n1": state(a), "n2": state(b, config="old"), "n3": None})
    assert actions == [
        Keep(a, "running with the same config"),
        Recreate(b, "its config changed"),
        Create(c, "no container"),
    ]
    actions = diff([a, b, c], {"n1": state(a, running=False), "n2": state(b), "n3": state(c)})
    assert actions == [
        Recreate(a, "its container is exited"),
        Recreate(b, "a new head on n1"),
        Recreate(c, "a new head on n1"),
    ]
    assert actions[1].argvs() == [["docker", "rm", "--force", "llmctl-demo"], b.docker_run_argv()]


def test_this_node_up_is_idempotent_too():
    fake = docker_node("localhost", "10.0.0.2")
    fake.reply(r"^docker exec llmctl-ray-worker ray status$", "Active:\n 1 node_a\n")
    options = dict(ip="10.0.0.2", head_ip="10.0.0.1", image="llmctl:latest", transport=fake)
    first = up_this_node("worker", **options)
    assert [r.action for r in first.rows] == ["created"] and first.changed
    (run,) = fake.ran(r"^docker run ")
    assert "--address=10.0.0.1:6379" in run and "--node-ip-address=10.0.0.2" in run
    fake.calls.clear()
    again = up_this_node("worker", **options)
    assert [r.action for r in again.rows] == ["unchanged"] and not again.changed
    assert changes(fake) == []
    with pytest.raises(NodeNetworkError, match="10.0.0.50 is not an address of this node"):
        up_this_node("worker", **dict(options, ip="10.0.0.50"))
    down = down_local(fake)
    assert [(r.role, r.action) for r in down.rows] == [("head", "absent"), ("worker", "removed")]
    assert not fake.containers


def test_this_node_up_on_the_mp_backend_is_an_idle_container_with_the_env():
    fake = docker_node("localhost", "10.0.0.2")
    fake.reply(r"^docker exec llmctl-mp-worker python3 -c ", VERSIONS)
    options = dict(ip="10.0.0.2", head_ip="10.0.0.1", image="llmctl:latest", transport=fake)
    report = up_this_node("worker", backend="mp", env={"NCCL_IB_HCA": "mlx5"}, **options)
    assert [(r.container, r.action) for r in report.rows] == [("llmctl-mp-worker", "created")]
    assert report.backend == "mp" and report.rows[0].versions["llmctl"] == "0.1.0"
    (run,) = fake.ran(r"^docker run ")
    assert run[-3:] == ["llmctl:latest", "sleep", "infinity"] and "llmctl.backend=mp" in run
    assert fake.ran(r"ray (start|status|list)") == []
    env = next(data for path, data in fake.files.items() if path.endswith(".env"))
    assert b"VLLM_HOST_IP=10.0.0.2\n" in env and b"GLOO_SOCKET_IFNAME=eth0\n" in env
    assert b"NCCL_IB_HCA=mlx5\n" in env
    [note] = report.notes
    assert "docker exec -d llmctl-mp-worker llmctl serve MODEL" in note
    assert "--node-rank R --master-addr 10.0.0.1 --headless" in note
    fake.calls.clear()
    again = up_this_node("worker", backend="mp", env={"NCCL_IB_HCA": "mlx5"}, **options)
    assert [r.action for r in again.rows] == ["unchanged"] and changes(fake) == []
    with pytest.raises(ConfigError, match="--num-gpus declares GPUs to Ray"):
        up_this_node("worker", backend="mp", gpus=1, **options)
    fake.reply(r"^docker exec llmctl-ray-worker ray status$", "Active:\n 1 node_a\n")
    up_this_node("worker", **options)  # a Ray container beside it: down removes both
    down = down_local(fake)
    assert [(r.role, r.container, r.action) for r in down.rows] == [
        ("head", "llmctl-ray-head", "absent"),
        ("worker", "llmctl-ray-worker", "removed"),
        ("worker", "llmctl-mp-worker", "removed"),
    ]
    assert not fake.containers


def test_down_removes_what_up_started_and_then_finds_nothing():
    fakes = nodes()
    up(fakes)
    with Cluster(parse_inventory(INVENTORY), fakes) as cluster:
        dry = cluster.down(dry_run=True)
        assert [r.action for r in dry.rows] == ["would remove"] * 3
        assert all(f.containers for f in fakes.values())
        report = cluster.down()
        assert [r.action for r in report.rows] == ["removed"] * 3 and report.changed
        for host, fake in fakes.items():
            assert not fake.containers
            ip = {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}[host]
            assert fake.ran(r"^rm -f -- ") == [["rm", "-f", "--", f"/root/.llmctl/demo-{ip}.env"]]
        again = cluster.down()
        assert [r.action for r in again.rows] == ["absent"] * 3 and not again.changed


VERSIONS = json.dumps({"python": "3.11.2", "torch": "2.13.0", "ray": None, "llmctl": "0.1.0"})


def mp_nodes(text: str = INVENTORY) -> dict[str, FakeTransport]:
    """Nodes whose containers answer llmctl's version script (an image without Ray)."""
    fakes = {n.host: docker_node(n.host, n.ip, model=MODEL) for n in parse_inventory(text).nodes}
    for fake in fakes.values():
        fake.reply(rf"^docker exec {CONTAINER} python3 -c ", VERSIONS)
    return fakes


def test_mp_backend_up_starts_idle_containers_with_the_env_and_no_ray():
    fakes = mp_nodes()
    report = up(fakes, backend="mp")
    assert [r.action for r in report.rows] == ["created"] * 3 and report.ray is None
    assert [r.versions["llmctl"] for r in report.rows] == ["0.1.0"] * 3
    assert "serve a model: llmctl serve -i cluster.yaml --backend mp" in report.notes
    for fake in fakes.values():
        [run] = fake.ran(r"^docker run ")
        assert run[-3:] == ["llmctl:latest", "sleep", "infinity"]  # nothing to join: no Ray
        assert "--init" in run and "llmctl.backend=mp" in run
        assert fake.ran(r"ray (start|status|list)") == []
        env = next(data for path, data in fake.files.items() if path.endswith(".env"))
        assert b"VLLM_HOST_IP=10.0.0." in env and b"RAY_AUTH_TOKEN" not in env
        assert b"NCCL_SOCKET_IFNAME=eth0\n" in env and b"GLOO_SOCKET_IFNAME=eth0\n" in env
    forget(fakes)
    again = up(fakes, backend="mp")
    assert [r.action for r in again.rows] == ["unchanged"] * 3
    assert all(changes(f) == [] for f in fakes.values())
    # The same inventory on Ray is another container on every node.
    ray_fakes = nodes()
    for host, fake in ray_fakes.items():
        fake.containers.update(fakes[host].containers)
    switched = up(ray_fakes)
    assert [r.action for r in switched.rows] == ["recreated"] * 3


def test_mp_backend_up_refuses_nodes_that_differ_or_lack_llmctl():
    fakes = mp_nodes()
    older = VERSIONS.replace("0.1.0", "0.0.9")
    fakes["n3"].reply(rf"^docker exec {CONTAINER} python3 -c ", older)
    with pytest.raises(ClusterError) as info:
        up(fakes, backend="mp")
    assert "different llmctl versions: n1 0.1.0, n2 0.1.0, n3 0.0.9" in info.value.message
    assert "cluster up --image NEW_TAG --image-file FILE" in info.value.hint
    assert "containers started by this run: n1, n2, n3" in info.value.hint
    fakes = mp_nodes()
    fakes["n2"].reply(rf"^docker exec {CONTAINER} python3 -c ", (1, "", "python3: not found"))
    fakes["n2"].reply(r"^docker logs", "python3: not found\n")
    with Cluster(parse_inventory(INVENTORY), fakes, ray_wait_s=0.0) as cluster:
        with pytest.raises(ClusterError, match="the container on the worker n2 is not ready"):
            cluster.up(backend="mp")


@pytest.mark.parametrize("backend", ["ray", "mp"])
def test_every_node_gets_one_cluster_secret_through_its_env_file(monkeypatch, backend):
    """The nodes prove it when they join (engine/distributed/join.py): the same on every node,
    never on a command line, and kept by a second `up` (read back from the head's env file)."""
    monkeypatch.setattr(launcher.secrets, "token_hex", token_hex)  # a real random one
    fakes = mp_nodes() if backend == "mp" else nodes()
    up(fakes, backend=backend)
    secrets, ran = set(), ""
    for fake in fakes.values():
        env = next(data for path, data in fake.files.items() if path.endswith(".env")).decode()
        secrets |= {line for line in env.splitlines() if line.startswith("LLMCTL_CLUSTER_SECRET=")}
        ran += " ".join(" ".join(argv) for argv in fake.ran(r"."))
    (line,) = secrets
    value = line.partition("=")[2]
    assert len(value) == 64 and value not in ran
    forget(fakes)
    again = up(fakes, backend=backend)
    assert [r.action for r in again.rows] == ["unchanged"] * 3
