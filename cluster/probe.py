"""Probe: read-only look at one node over its transport (Docker, image, addresses, model,
the cluster's container). `cluster up` probes every node in parallel before it changes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.cluster import commands
from llmctl.cluster.errors import ClusterError
from llmctl.cluster.parsers import (
    Address,
    ContainerState,
    DockerInfo,
    hashed_files,
    model_fingerprint,
    parse_docker_info,
    parse_docker_inspect,
    parse_ip_addr,
    parse_listing,
    parse_sha256sum,
)
from llmctl.cluster.transport import COMMAND_NOT_FOUND, CommandResult, Transport


@dataclass
class NodeProbe:
    host: str
    error: ClusterError | None = None  # could not connect at all
    docker: DockerInfo | None = None
    docker_error: CommandResult | None = None
    image_id: str | None = None
    addresses: list[Address] = field(default_factory=list)
    model_files: dict[str, int] | None = None  # None: the model path is missing
    model_fingerprint: str | None = None
    container: ContainerState | None = None
    home: str = "/root"
    hostname: str | None = None


def probe_node(
    transport: Transport, image: str | None, model: str | None, container: str
) -> NodeProbe:
    probe = NodeProbe(transport.name)
    try:
        probe.home = transport.home()
        named = transport.run(["uname", "-n"])
        probe.hostname = (named.stdout.strip() or None) if named.ok else None
        info = transport.run(commands.docker_info_argv(), timeout=30)
        if info.ok:
            probe.docker = parse_docker_info(info.stdout)
        else:
            probe.docker_error = info
        probe.addresses = parse_ip_addr(transport.run(commands.ip_addr_argv()).stdout)
        if probe.docker is not None:
            if image:
                found = transport.run(commands.image_id_argv(image))
                probe.image_id = found.stdout.strip() if found.ok else None
            probe.container = inspect_container(transport, container)
        if model:
            probe.model_files, probe.model_fingerprint = fingerprint(transport, model)
    except ClusterError as exc:
        probe.error = exc
    return probe


def inspect_container(transport: Transport, container: str) -> ContainerState | None:
    result = transport.run(commands.docker_inspect_argv(container))
    return parse_docker_inspect(result.stdout) if result.ok else None


def fingerprint(transport: Transport, model: str) -> tuple[dict[str, int] | None, str | None]:
    listing = transport.run(commands.model_listing_argv(model))
    files = parse_listing(listing.stdout) if listing.ok else {}
    if not files:
        return None, None
    digests: dict[str, str] = {}
    names = hashed_files(files)
    if names:
        result = transport.run(commands.sha256_argv([f"{model.rstrip('/')}/{n}" for n in names]))
        digests = parse_sha256sum(result.stdout)
    return files, model_fingerprint(files, digests)


def docker_problem(result: CommandResult) -> str:
    """Why `docker info` failed, in a user's words."""
    if result.returncode == COMMAND_NOT_FOUND or "command not found" in result.stderr:
        return "Docker is not installed"
    return f"the Docker daemon does not answer ({result.error_line()})"
