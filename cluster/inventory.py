"""The inventory: which nodes a cluster has, how to reach them, what GPUs they hold.

One YAML file (see templates/cluster.yaml) serves `llmctl plan` and `llmctl cluster`. Parsing
keeps each value's line, so an unknown key, a missing field or an impossible value is reported as
"cluster.yaml line 9, nodes[1].gpus: ...". Pure: reading the file is the only I/O.
"""

from __future__ import annotations

import difflib
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.cluster.errors import InventoryError
from llmctl.engine.config.options import option

INTERCONNECTS = ("nvlink", "pcie")


@dataclass(frozen=True)
class SSHSpec:
    user: str = "root"
    key: str | None = None
    port: int = 22


@dataclass(frozen=True)
class NodeSpec:
    host: str  # how to reach it over SSH
    ip: str  # its VLLM_HOST_IP (Ray's node IP); defaults to host
    head: bool = False
    gpus: int = 0  # devices Ray declares on this node (logical ones on CPU-only nodes)
    gpu_memory_gib: float | None = None
    interconnect: str = "nvlink"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Inventory:
    name: str
    nodes: tuple[NodeSpec, ...]
    image: str | None = None
    model: str | None = None
    hf_home: str | None = None
    ssh: SSHSpec = SSHSpec()
    env: dict[str, str] = field(default_factory=dict)
    source: str = "<flags>"

    @property
    def head(self) -> NodeSpec:
        return next(n for n in self.nodes if n.head)

    @property
    def workers(self) -> tuple[NodeSpec, ...]:
        return tuple(n for n in self.nodes if not n.head)


_TOP_KEYS = {"name", "image", "model", "hf_home", "ssh", "env", "nodes"}
_SSH_KEYS = {"user", "key", "port"}
_NODE_KEYS = {"host", "ip", "head", "gpus", "gpu_memory_gib", "interconnect", "env"}


class _Node:
    """A YAML value with the line it starts on (1-based)."""

    def __init__(self, value: Any, line: int) -> None:
        self.value = value
        self.line = line


def _compose(text: str, source: str) -> _Node:
    import yaml

    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise InventoryError(
            f"{source} {where}: not valid YAML ({getattr(exc, 'problem', exc)})",
            "see templates/cluster.yaml for the format",
        ) from None
    if root is None:
        raise InventoryError(f"{source} is empty", "see templates/cluster.yaml for the format")
    return _convert(root)


def _convert(node) -> _Node:
    import yaml

    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        return _Node({k.value: (_convert(v), k.start_mark.line + 1) for k, v in node.value}, line)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_convert(v) for v in node.value], line)
    loader = yaml.SafeLoader("")
    return _Node(loader.construct_object(node, deep=True), line)


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, line: int, where: str, message: str, hint: str) -> InventoryError:
        return InventoryError(f"{self.source} line {line}, {where}: {message}", hint)

    def mapping(self, node: _Node, where: str, allowed: set[str]) -> dict[str, tuple]:
        if not isinstance(node.value, dict):
            raise self.fail(node.line, where, "expected a mapping (key: value)", "see the template")
        for key, (_, line) in node.value.items():
            if key not in allowed:
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {sorted(allowed)}"
                raise self.fail(line, f"{where}.{key}" if where else key, "unknown key", hint)
        return node.value

    def get(self, mapping: dict, key: str, where: str, kind, required: bool, line: int):
        if key not in mapping:
            if required:
                raise self.fail(line, f"{where}{key}", "missing", f"add `{key}:`")
            return None
        node, key_line = mapping[key]
        value = node.value
        if value is None and not required:
            return None
        ok = isinstance(value, kind) and not (
            kind in (int, float, (int, float)) and isinstance(value, bool)
        )
        if not ok:
            names = {
                str: "a string",
                int: "an integer",
                bool: "true or false",
                (int, float): "a number",
            }
            raise self.fail(
                key_line, f"{where}{key}", f"expected {names.get(kind, kind)}, got {value!r}",
                "fix the value",
            )  # fmt: skip
        return value

    def env(self, mapping: dict, where: str) -> dict[str, str]:
        if "env" not in mapping:
            return {}
        node, line = mapping["env"]
        if node.value is None:
            return {}
        if not isinstance(node.value, dict):
            raise self.fail(line, f"{where}env", "expected a mapping NAME: value", "fix the value")
        out = {}
        for name, (value_node, value_line) in node.value.items():
            value = value_node.value
            if not isinstance(name, str) or not name.replace("_", "a").isalnum():
                raise self.fail(value_line, f"{where}env", f"bad variable name {name!r}",
                                "use letters, digits and _")  # fmt: skip
            if isinstance(value, dict | list) or value is None:
                raise self.fail(value_line, f"{where}env.{name}", "expected a plain value",
                                "quote it as a string")  # fmt: skip
            out[name] = str(value).lower() if isinstance(value, bool) else str(value)
        return out


def parse_inventory(text: str, source: str = "cluster.yaml") -> Inventory:
    reader = _Reader(source)
    root = _compose(text, source)
    top = reader.mapping(root, "", _TOP_KEYS)
    name = reader.get(top, "name", "", str, True, root.line)
    ssh = SSHSpec()
    if "ssh" in top:
        ssh_node, _ = top["ssh"]
        ssh_map = reader.mapping(ssh_node, "ssh", _SSH_KEYS)
        port = reader.get(ssh_map, "port", "ssh.", int, False, ssh_node.line)
        if port is not None and not 0 < port < 65536:
            raise reader.fail(ssh_map["port"][1], "ssh.port", f"{port} is not a port",
                              "use 1-65535")  # fmt: skip
        ssh = SSHSpec(
            user=reader.get(ssh_map, "user", "ssh.", str, False, ssh_node.line) or "root",
            key=reader.get(ssh_map, "key", "ssh.", str, False, ssh_node.line),
            port=port or 22,
        )
    if "nodes" not in top:
        raise reader.fail(root.line, "nodes", "missing", "list the cluster's nodes under `nodes:`")
    nodes_node, nodes_line = top["nodes"]
    if not isinstance(nodes_node.value, list) or not nodes_node.value:
        raise reader.fail(nodes_line, "nodes", "expected a non-empty list of nodes",
                          "add `- {host: ..., gpus: ...}` entries")  # fmt: skip
    nodes = [_parse_node(reader, item, i) for i, item in enumerate(nodes_node.value)]
    heads = [i for i, n in enumerate(nodes) if n.head]
    if len(heads) > 1:
        line = nodes_node.value[heads[1]].line
        raise reader.fail(line, f"nodes[{heads[1]}].head", f"nodes {heads} are all heads",
                          "mark exactly one node `head: true`")  # fmt: skip
    if not heads:
        first = nodes[0]
        nodes[0] = NodeSpec(**{**first.__dict__, "head": True})  # the first node leads
    seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for value in {node.host, node.ip}:
            if value in seen and seen[value] != i:
                raise reader.fail(nodes_node.value[i].line, f"nodes[{i}]",
                                  f"{value} is also nodes[{seen[value]}]",
                                  "give each node its own host and ip")  # fmt: skip
            seen[value] = i
    return Inventory(
        name=name,
        nodes=tuple(nodes),
        image=reader.get(top, "image", "", str, False, root.line),
        model=reader.get(top, "model", "", str, False, root.line),
        hf_home=reader.get(top, "hf_home", "", str, False, root.line),
        ssh=ssh,
        env=reader.env(top, ""),
        source=source,
    )


def _parse_node(reader: _Reader, item: _Node, i: int) -> NodeSpec:
    where = f"nodes[{i}]."
    node = reader.mapping(item, f"nodes[{i}]", _NODE_KEYS)
    host = reader.get(node, "host", where, str, True, item.line)
    ip = reader.get(node, "ip", where, str, False, item.line) or host
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        line = node["ip"][1] if "ip" in node else node["host"][1]
        raise reader.fail(line, f"{where}ip", f"{ip!r} is not an IP address",
                          "give the node's IP (its VLLM_HOST_IP) as `ip:`") from None  # fmt: skip
    gpus = reader.get(node, "gpus", where, int, True, item.line)
    if gpus < 0:
        raise reader.fail(node["gpus"][1], f"{where}gpus", f"{gpus} GPUs", "use 0 or more")
    memory = reader.get(node, "gpu_memory_gib", where, (int, float), False, item.line)
    if memory is not None and memory <= 0:
        raise reader.fail(node["gpu_memory_gib"][1], f"{where}gpu_memory_gib",
                          f"{memory} GiB per GPU", "give a positive size, e.g. 80")  # fmt: skip
    interconnect = reader.get(node, "interconnect", where, str, False, item.line) or "nvlink"
    if interconnect not in INTERCONNECTS:
        raise reader.fail(node["interconnect"][1], f"{where}interconnect",
                          f"unknown interconnect {interconnect!r}",
                          f"use one of {', '.join(INTERCONNECTS)}")  # fmt: skip
    return NodeSpec(
        host=host,
        ip=ip,
        head=bool(reader.get(node, "head", where, bool, False, item.line)),
        gpus=gpus,
        gpu_memory_gib=float(memory) if memory is not None else None,
        interconnect=interconnect,
        env=reader.env(node, where),
    )


def load_inventory(path: str | Path) -> Inventory:
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise InventoryError(
            f"cannot read the inventory {path}: {exc.strerror}",
            "pass --inventory with a path to a cluster.yaml (see templates/cluster.yaml)",
        ) from None
    return parse_inventory(text, str(path))


def inventory_from_flags(
    nodes: int, gpus_per_node: int, gpu_memory_gib: float, interconnect: str = "nvlink"
) -> Inventory:
    """The inventory --nodes/--gpus-per-node/--gpu-memory-gib/--interconnect describe."""
    if nodes < 1 or gpus_per_node < 1 or gpu_memory_gib <= 0:
        raise InventoryError(
            f"--nodes {nodes} --gpus-per-node {gpus_per_node} --gpu-memory-gib {gpu_memory_gib}"
            " describes no GPU",
            "give at least one node with one GPU and a positive memory size",
        )
    if interconnect not in INTERCONNECTS:
        raise InventoryError(
            f"unknown interconnect {interconnect!r}", f"use one of {', '.join(INTERCONNECTS)}"
        )
    return Inventory(
        name="flags",
        nodes=tuple(
            NodeSpec(
                host=f"node{i}",
                ip=f"10.0.0.{i + 1}",
                head=i == 0,
                gpus=gpus_per_node,
                gpu_memory_gib=gpu_memory_gib,
                interconnect=interconnect,
            )
            for i in range(nodes)
        ),
    )


INVENTORY_PANEL = "Inventory"
_PLAN_ONLY = dict(panel=INVENTORY_PANEL, commands=("plan",), show_default=True)


@dataclass(frozen=True)
class InventoryFlags:
    """The cluster a command plans for: an inventory file, or nodes described by flags."""

    inventory: str | None = option(
        "The cluster's inventory file (see templates/cluster.yaml).",
        default=None,
        aliases=("-i",),
        panel=INVENTORY_PANEL,
        commands=("plan",),
        default_help="",
    )
    nodes: int = option("Nodes, without --inventory.", default=1, **_PLAN_ONLY)
    gpus_per_node: int = option("GPUs per node, without --inventory.", default=8, **_PLAN_ONLY)
    gpu_memory_gib: float = option(
        "Memory per GPU, without --inventory.", default=80.0, **_PLAN_ONLY
    )
    interconnect: str = option(
        "nvlink or pcie, without --inventory.", default="nvlink", **_PLAN_ONLY
    )

    def resolve(self) -> Inventory:
        if self.inventory:
            return load_inventory(self.inventory)
        return inventory_from_flags(
            self.nodes, self.gpus_per_node, self.gpu_memory_gib, self.interconnect
        )
