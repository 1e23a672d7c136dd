"""The inventory file: the template parses, and every malformed case names its line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.cluster.errors import InventoryError
from llmctl.cluster.inventory import inventory_from_flags, load_inventory, parse_inventory

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "cluster.yaml"

GOOD = """\
name: demo
ssh: {user: ubuntu, port: 2222}
nodes:
  - {host: 10.0.0.1, head: true, gpus: 8, gpu_memory_gib: 80}
  - {host: 10.0.0.2, ip: 10.0.0.12, gpus: 8, gpu_memory_gib: 80, env: {NCCL_SOCKET_IFNAME: eth1}}
"""


def test_template_parses():
    inv = load_inventory(TEMPLATE)
    assert inv.name == "demo" and inv.image == "llmctl:latest"
    assert [n.host for n in inv.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert inv.head.env == {"NCCL_SOCKET_IFNAME": "eth0"}
    assert inv.env == {"NCCL_IB_HCA": "mlx5"}
    assert inv.ssh.key == "~/.ssh/id_ed25519"


def test_defaults_and_values():
    inv = parse_inventory(GOOD)
    assert inv.ssh.user == "ubuntu" and inv.ssh.port == 2222
    assert inv.nodes[0].ip == "10.0.0.1"  # defaults to host
    assert inv.nodes[1].ip == "10.0.0.12"
    assert inv.workers[0].env == {"NCCL_SOCKET_IFNAME": "eth1"}
    assert inv.nodes[1].interconnect == "nvlink"


def test_first_node_leads_when_none_is_marked():
    inv = parse_inventory(
        "name: x\nnodes:\n  - {host: 10.0.0.5, gpus: 1}\n  - {host: 10.0.0.6, gpus: 1}\n"
    )
    assert inv.head.host == "10.0.0.5"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: x\nnodez: []\n", "line 2, nodez: unknown key"),
        ("name: x\nnodes:\n  - {host: 10.0.0.1, gpu: 8}\n", "line 3, nodes[0].gpu: unknown key"),
        ("name: x\n", "nodes: missing"),
        ("nodes:\n  - {host: 10.0.0.1, gpus: 1}\n", "name: missing"),
        ("name: x\nnodes:\n  - {gpus: 1}\n", "line 3, nodes[0].host: missing"),
        ("name: x\nnodes:\n  - {host: 10.0.0.1}\n", "line 3, nodes[0].gpus: missing"),
        ("name: x\nnodes:\n  - {host: 10.0.0.1, gpus: -2}\n", "nodes[0].gpus: -2 GPUs"),
        (
            "name: x\nnodes:\n  - {host: 10.0.0.1, gpus: two}\n",
            "nodes[0].gpus: expected an integer",
        ),
        (
            "name: x\nnodes:\n  - {host: 10.0.0.1, gpus: 1, gpu_memory_gib: 0}\n",
            "nodes[0].gpu_memory_gib: 0 GiB per GPU",
        ),
        (
            "name: x\nnodes:\n  - {host: 10.0.0.1, gpus: 1, interconnect: infiniband}\n",
            "nodes[0].interconnect: unknown interconnect 'infiniband'",
        ),
        ("name: x\nnodes:\n  - {host: node-a, gpus: 1}\n", "nodes[0].ip: 'node-a' is not an IP"),
        (
            "name: x\nnodes:\n  - {host: 10.0.0.1, gpus: 1, head: true}\n"
            "  - {host: 10.0.0.2, gpus: 1, head: true}\n",
            "line 4, nodes[1].head: nodes [0, 1] are all heads",
        ),
        (
            "name: x\nnodes:\n  - {host: 10.0.0.1, gpus: 1}\n  - {host: 10.0.0.1, gpus: 1}\n",
            "line 4, nodes[1]: 10.0.0.1 is also nodes[0]",
        ),
        ("name: x\nssh: {port: 70000}\nnodes: [{host: 10.0.0.1, gpus: 1}]\n", "ssh.port: 70000"),
        ("name: x\nssh: {usr: me}\nnodes: [{host: 10.0.0.1, gpus: 1}]\n", "ssh.usr: unknown key"),
        ("name: x\nenv: [A, B]\nnodes: [{host: 10.0.0.1, gpus: 1}]\n", "env: expected a mapping"),
        ("name: x\nnodes: []\n", "nodes: expected a non-empty list"),
        ("name: [x\n", "not valid YAML"),
        ("", "is empty"),
    ],
)
def test_malformed_inventories(text, expected):
    with pytest.raises(InventoryError) as err:
        parse_inventory(text, "cluster.yaml")
    assert expected in err.value.message
    assert err.value.message.startswith("cluster.yaml")
    assert err.value.hint


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(InventoryError) as err:
        parse_inventory("name: x\nnodes:\n  - {host: 10.0.0.1, gpus: 1, gpu_memory: 80}\n")
    assert "gpu_memory_gib" in err.value.hint


def test_missing_file(tmp_path):
    with pytest.raises(InventoryError) as err:
        load_inventory(tmp_path / "nope.yaml")
    assert "nope.yaml" in err.value.message


def test_flags():
    inv = inventory_from_flags(2, 4, 24, "pcie")
    assert len(inv.nodes) == 2 and inv.nodes[1].gpus == 4 and inv.nodes[0].interconnect == "pcie"
    with pytest.raises(InventoryError):
        inventory_from_flags(0, 8, 80)
