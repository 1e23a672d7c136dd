"""One collector, one check per invariant: `cluster up`'s preflight and `llmctl doctor` read a
node's facts through the same probe (here over a recording fake transport) and decide IP
ownership and model identity with the same functions, so they cannot disagree."""

from __future__ import annotations

from fake_transport import docker_node

from llmctl.cluster.doctor.doctor_checks import check_host_ip, check_model
from llmctl.cluster.doctor.node_facts import collect_local_report, report_of
from llmctl.cluster.errors import ModelMismatchError, NodeNetworkError
from llmctl.cluster.inventory import parse_inventory
from llmctl.cluster.launch.invariants import differing_files, model_copies, own_address
from llmctl.cluster.launch.parsers import parse_ip_addr
from llmctl.cluster.launch.preflight import probe_problems
from llmctl.cluster.launch.probe import probe_node

MODEL = {"config.json": '{"hidden_size": 8}', "model.safetensors": "weights"}
INVENTORY = """\
name: demo
image: llmctl:latest
model: /models/smol
nodes:
  - {host: n1, ip: 10.0.0.1, head: true, gpus: 2}
  - {host: n2, ip: 10.0.0.2, gpus: 2}
  - {host: n3, ip: 10.0.0.3, gpus: 2}
"""


def test_own_address():
    addresses = parse_ip_addr(
        "1: lo    inet 127.0.0.1/8 scope host lo\\\n2: eth0    inet 10.0.0.2/24 scope global eth0\\"
    )
    assert own_address("10.0.0.2", addresses).ifname == "eth0"
    assert own_address("10.0.0.9", addresses) is None


def test_model_copies_against_the_head_or_the_first_copy():
    assert [c.status for c in model_copies(["a", "a", "b", None])] == [
        "reference", "same", "differs", "missing",
    ]  # fmt: skip
    # The head lacks it: `up` compares with the first copy, the doctor has no reference.
    assert [c.status for c in model_copies([None, "a", "b"])] == ["missing", "reference", "differs"]
    assert model_copies([None, "a", "b"])[2].reference == 1
    no_head = model_copies([None, "a", "b"], fallback=False)
    assert [c.status for c in no_head] == ["missing", "unknown", "unknown"]
    assert differing_files({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b", "c"]


def test_the_doctor_collects_over_a_transport_what_cluster_up_probes():
    fake = docker_node("n2", "10.0.0.2", hostname="gpu-b7", model=MODEL)
    fake.reply(r"^stat --file-system", "4096 2621440\n")
    fake.reply(r"^nvidia-smi -L$", "GPU 0: H100 (UUID: GPU-0)\nGPU 1: H100 (UUID: GPU-1)\n")
    fake.reply(r"^nvidia-smi topo -m$", "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n")
    report = collect_local_report("/models/smol", transport=fake)
    assert fake.ran(r"^docker ") == []  # inside a container the doctor asks nothing of Docker
    probe = probe_node(fake, "llmctl:latest", "/models/smol", "llmctl-demo")
    assert report.node == "gpu-b7"
    assert report.addresses == tuple(probe.addresses)
    assert report.model_fingerprint == probe.model_fingerprint is not None
    assert (report.shm_bytes, report.gpus, report.nvlink) == (10 * (1 << 30), 2, True)


def test_preflight_and_doctor_agree_on_the_same_facts():
    inventory = parse_inventory(INVENTORY)
    fakes = {n.host: docker_node(n.host, n.ip, model=MODEL) for n in inventory.nodes}
    fakes["n2"] = docker_node("n2", "10.0.0.9", model=MODEL)  # VLLM_HOST_IP not its own
    fakes["n3"] = docker_node("n3", "10.0.0.3", model=dict(MODEL, **{"config.json": "{}"}))
    probes = {
        h: probe_node(f, "llmctl:latest", "/models/smol", "llmctl-demo", devices=True)
        for h, f in fakes.items()
    }
    found = probe_problems(inventory, probes, image="llmctl:latest", image_file=None,
                           sync_model=False)  # fmt: skip
    assert {(p.host, p.kind) for p in found} == {
        ("n2", NodeNetworkError),
        ("n3", ModelMismatchError),
    }
    reports = [
        report_of(probes[n.host], {"VLLM_HOST_IP": n.ip}, model="/models/smol")
        for n in inventory.nodes
    ]
    ip_rows = [check_host_ip(r, len(reports)) for r in reports]
    assert [r.status for r in ip_rows] == ["pass", "fail", "pass"]
    assert "VLLM_HOST_IP=10.0.0.2 is not an address of n2" in ip_rows[1].detail
    model_rows = check_model(reports)
    assert [r.status for r in model_rows] == ["pass", "pass", "fail"]
    assert "differs from n1's" in model_rows[2].detail
