"""What one node's container should be: a frozen NodeLaunch, built by pure functions.

`node_launches(inventory, facts, ...)` turns the inventory plus what the probe found on each node
(the interface owning its IP, the image ID, the NVIDIA runtime) into one NodeLaunch per node. Its
`config_hash` is stored as a container label, so a second `cluster up` compares the running
container with the plan and leaves it alone when they agree.

Environment: everything reaches the container through an env file written with mode 0600 on
the node (`docker run --env-file`), so no value, secret or not, appears on a command line that
`ps` shows. Order of precedence, last wins: VLLM_HOST_IP and the NCCL/Gloo interface variables
derived from the node, the inventory's `env`, the node's own `env`, then the secrets llmctl adds
(HF_TOKEN from the caller's environment when the inventory does not set it; the Ray token).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from dataclasses import dataclass

from llmctl.cluster.errors import ConfigError
from llmctl.cluster.inventory import Inventory, NodeSpec, ordered_nodes
from llmctl.cluster.launch.commands import (
    BACKENDS,
    DEFAULT_SHM_SIZE,
    HF_HOME_IN_CONTAINER,
    LABEL_BACKEND,
    LABEL_CLUSTER,
    LABEL_CONFIG,
    LABEL_ROLE,
    RAY_PORT,
    idle_argv,
    ray_start_argv,
)

INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
FORWARDED_SECRETS = ("HF_TOKEN",)


@dataclass(frozen=True)
class NodeFacts:
    """What the probe found on a node that the launch depends on."""

    ifname: str | None  # the interface that owns the node's IP
    image_id: str | None
    nvidia_runtime: bool = False
    home: str = "/root"
    hostname: str | None = None  # the node's own name (`uname -n`)


@dataclass(frozen=True)
class NodeLaunch:
    cluster: str
    host: str
    ip: str  # VLLM_HOST_IP, and Ray's --node-ip-address
    role: str  # "head" or "worker"
    head_ip: str
    container: str
    image: str
    image_id: str | None
    gpus: int | None  # --num-gpus (None: let Ray detect)
    env: tuple[tuple[str, str], ...]
    env_file: str  # path on the node
    mounts: tuple[tuple[str, str, bool], ...]  # (node path, container path, read-only)
    shm_size: str = DEFAULT_SHM_SIZE
    nvidia: bool = False  # --gpus all
    ray_port: int = RAY_PORT
    # (name, ip) of every node, written to the container's /etc/hosts: without DNS for the
    # cluster's addresses, each reverse lookup (torch.distributed's TCPStore makes them) waits
    # for the resolver's timeout, 10 s per lookup on the test bed.
    peers: tuple[tuple[str, str], ...] = ()
    # The node's own name, mapped to its IP too: Gloo without GLOO_SOCKET_IFNAME, and other
    # libraries, resolve it, and an unresolvable one costs the resolver's timeout each time.
    hostname: str | None = None
    # ray: the container runs `ray start --block`; mp: it idles until `serve -i --backend mp`
    # execs this node's `llmctl serve --nnodes ...` in it.
    backend: str = "ray"

    @property
    def config_hash(self) -> str:
        """Everything that makes the container what it is; secrets enter only as a digest."""
        fields = {
            k: v for k, v in self.__dict__.items() if k not in ("env_file",)
        }  # the env file's path is where, not what
        if self.backend == "ray":
            del fields["backend"]  # the hashes of Ray containers started before it existed
        blob = json.dumps(fields, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def env_file_text(self) -> str:
        return "".join(f"{name}={value}\n" for name, value in self.env)

    def printable_env(self) -> dict[str, str]:
        return {k: ("***" if is_secret(k) else v) for k, v in self.env}

    def ray_start_argv(self) -> list[str]:
        return ray_start_argv(self.role, self.ip, self.head_ip, self.gpus, self.ray_port)

    def command_argv(self) -> list[str]:
        """What the container runs: Ray's node, or (mp) an idle process to exec into."""
        return self.ray_start_argv() if self.backend == "ray" else idle_argv()

    def docker_run_argv(self) -> list[str]:
        argv = [
            "docker", "run", "--detach", "--name", self.container,
            "--network", "host", "--shm-size", self.shm_size,
            "--label", f"{LABEL_CLUSTER}={self.cluster}",
            "--label", f"{LABEL_ROLE}={self.role}",
            "--label", f"{LABEL_CONFIG}={self.config_hash}",
            "--env-file", self.env_file,
        ]  # fmt: skip
        if self.backend != "ray":
            argv += ["--label", f"{LABEL_BACKEND}={self.backend}", "--init"]
        hosts = dict(self.peers)
        if self.hostname and self.hostname not in hosts:
            hosts[self.hostname] = self.ip
        for name, ip in hosts.items():
            argv += ["--add-host", f"{name}:{ip}"]
        if self.nvidia:
            argv += ["--gpus", "all"]
        for source, target, read_only in self.mounts:
            argv += ["--volume", f"{source}:{target}" + (":ro" if read_only else "")]
        return argv + [self.image, *self.command_argv()]


def is_secret(name: str) -> bool:
    return any(marker in name.upper() for marker in SECRET_MARKERS)


def container_name(cluster: str) -> str:
    """One container per node and cluster: the same stable name on every node."""
    return f"llmctl-{cluster}"


def _check_env(env: dict[str, str], where: str) -> None:
    for name, value in env.items():
        if "\n" in value or "\r" in value:
            raise ConfigError(
                f"{where} env {name} contains a line break",
                "Docker env files hold one NAME=value per line; remove the line break",
            )


def node_env(
    inventory: Inventory,
    node: NodeSpec,
    ifname: str | None,
    secrets: dict[str, str],
) -> tuple[tuple[str, str], ...]:
    env: dict[str, str] = {"VLLM_HOST_IP": node.ip}
    if ifname is not None:
        for name in INTERFACE_VARIABLES:
            env[name] = ifname
    _check_env(inventory.env, "the inventory's")
    _check_env(node.env, f"node {node.host}'s")
    env.update(inventory.env)
    env.update(node.env)
    for name, value in secrets.items():
        env.setdefault(name, value)
    return tuple(env.items())


def node_launches(
    inventory: Inventory,
    facts: dict[str, NodeFacts],
    *,
    secrets: dict[str, str] | None = None,
    image: str | None = None,
    backend: str = "ray",
) -> list[NodeLaunch]:
    """One NodeLaunch per inventory node (head first, in node-rank order for the mp backend),
    from the facts probed on each node."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", f"use one of: {', '.join(BACKENDS)}")
    image = image or inventory.image
    if not image:
        raise ConfigError(
            f"{inventory.source} names no container image", "add `image: llmctl:latest`"
        )
    head = inventory.head
    name = container_name(inventory.name)
    ordered = ordered_nodes(inventory)
    peers = tuple((_peer_name(name, i, n), n.ip) for i, n in enumerate(ordered))
    launches = []
    for node in ordered:
        fact = facts[node.host]
        mounts = []
        if inventory.hf_home:
            mounts.append((inventory.hf_home, HF_HOME_IN_CONTAINER, False))
        if inventory.model:
            mounts.append((inventory.model, inventory.model, True))
        launches.append(
            NodeLaunch(
                cluster=inventory.name,
                host=node.host,
                ip=node.ip,
                role="head" if node.head else "worker",
                head_ip=head.ip,
                container=name,
                image=image,
                image_id=fact.image_id,
                gpus=node.gpus,
                env=node_env(inventory, node, fact.ifname, secrets or {}),
                env_file=env_file_path(fact.home, inventory.name, node.ip),
                mounts=tuple(mounts),
                nvidia=fact.nvidia_runtime and node.gpus > 0,
                peers=peers,
                hostname=fact.hostname,
                backend=backend,
            )
        )
    return launches


def _peer_name(container: str, index: int, node: NodeSpec) -> str:
    """A node's name in the containers' /etc/hosts: its SSH host name, or for an address,
    CONTAINER-INDEX (the head is 0)."""
    try:
        ipaddress.ip_address(node.host)
    except ValueError:
        return node.host
    return f"{container}-{index}"


def env_file_path(home: str, name: str, ip: str) -> str:
    """Where a node's container environment lives on that node. The node's IP is in the name:
    home directories are often shared between nodes (NFS), and each node needs its own file."""
    return f"{home}/.llmctl/{name}-{ip}.env"


def local_container_name(role: str, backend: str = "ray") -> str:
    """`cluster up --head/--worker`: one stable name per role and backend on this node."""
    return f"llmctl-{backend}-{role}"


def local_launch(
    role: str,
    ip: str,
    head_ip: str,
    image: str,
    facts: NodeFacts,
    *,
    hf_home: str | None = None,
    gpus: int | None = None,
    env: dict[str, str] | None = None,
    shm_size: str = DEFAULT_SHM_SIZE,
    backend: str = "ray",
) -> NodeLaunch:
    """This node's container for `cluster up --head/--worker` (the run_cluster.sh layout); on
    the mp backend an idle one, as `cluster up -i --backend mp` starts, to exec `llmctl serve
    --nnodes ...` in."""
    if role not in ("head", "worker"):
        raise ConfigError(f"unknown role {role!r}", "use --head or --worker")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", f"use one of: {', '.join(BACKENDS)}")
    if backend != "ray" and gpus is not None:
        raise ConfigError(
            "--num-gpus declares GPUs to Ray; the mp backend has no Ray",
            "drop --num-gpus (each node's `llmctl serve` uses the GPUs its container sees)",
        )
    if gpus is not None and gpus < 0:
        raise ConfigError(f"--num-gpus {gpus}", "use 0 or more")
    variables: dict[str, str] = {"VLLM_HOST_IP": ip}
    if facts.ifname is not None:
        for name in INTERFACE_VARIABLES:
            variables[name] = facts.ifname
    _check_env(env or {}, "--env")
    variables.update(env or {})
    return NodeLaunch(
        cluster="local",
        host="localhost",
        ip=ip,
        role=role,
        head_ip=head_ip,
        container=local_container_name(role, backend),
        image=image,
        image_id=facts.image_id,
        gpus=gpus,
        env=tuple(variables.items()),
        env_file=env_file_path(facts.home, local_container_name(role, backend), ip),
        mounts=((hf_home, HF_HOME_IN_CONTAINER, False),) if hf_home else (),
        shm_size=shm_size,
        nvidia=facts.nvidia_runtime,
        hostname=facts.hostname,
        backend=backend,
    )
