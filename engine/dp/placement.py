"""DPPlacement: which data-parallel replicas run on this node, as vLLM's multi-node flags say.

Pure: no sockets, no torch. Validated once, at the edge (EngineArgs), so a bad combination fails
before anything loads.

    # head (API server, router, replicas 0 .. L-1), at 10.0.0.1
    llmctl serve MODEL -dp 4 --data-parallel-size-local 2 \\
        --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345
    # another node (replicas 2, 3; no API server)
    llmctl serve MODEL -dp 4 --data-parallel-size-local 2 --data-parallel-start-rank 2 \\
        --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345 --headless

The head always runs replicas 0 .. L-1 (L may be 0: the API server alone); every other replica
is expected from a --headless node, which runs --data-parallel-start-rank S .. S + L - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.engine.errors import ConfigError

DEFAULT_RPC_PORT = 29550  # vLLM's data_parallel_rpc_port


@dataclass(frozen=True)
class DPPlacement:
    size: int = 1  # --data-parallel-size: replicas in all, on every node
    size_local: int | None = None  # --data-parallel-size-local; None: all of them (one node)
    start_rank: int | None = None  # --data-parallel-start-rank (a --headless node's first)
    address: str | None = None  # --data-parallel-address: the head's
    rpc_port: int | None = None  # --data-parallel-rpc-port: the head's port for replicas
    headless: bool = False  # this node runs replicas for the head's router, no API server
    nnodes: int = 1  # --nnodes: a replica's ranks across nodes (refused with replicas)

    def __post_init__(self) -> None:
        n, local, start = self.size, self.local, self.first_rank
        if self.nnodes > 1 and n > 1:
            raise ConfigError(
                "--data-parallel-size with --nnodes: multi-node data parallel is not yet "
                "supported with replicas whose ranks span nodes",
                "keep each replica on one node: --data-parallel-size N alone on this node, or "
                "--data-parallel-size-local with --data-parallel-address to place whole replicas "
                "on several nodes",
            )
        if local < 0:
            raise ConfigError(
                f"--data-parallel-size-local must be 0 or more, got {local}",
                "give the number of replicas this node runs",
            )
        if local > n:
            raise ConfigError(
                f"--data-parallel-size-local {local} is more than --data-parallel-size {n} "
                "(the replicas on every node together)",
                f"use --data-parallel-size-local {n} or less, or raise --data-parallel-size",
            )
        if not self.headless and self.start_rank not in (None, 0):
            raise ConfigError(
                f"--data-parallel-start-rank {self.start_rank} on the head: the head runs "
                f"replicas 0 to {max(0, local - 1)}",
                "give --data-parallel-start-rank only to the --headless nodes",
            )
        if start < 0 or start + local > n:
            raise ConfigError(
                f"replicas {start} to {start + local - 1} (--data-parallel-start-rank {start}, "
                f"--data-parallel-size-local {local}) are not all ranks of --data-parallel-size "
                f"{n} (0 to {n - 1})",
                "the local sizes of all nodes must add up to --data-parallel-size; give each "
                "node a start rank so that its replicas end at or before it",
            )
        if self.headless and local == 0:
            raise ConfigError(
                "--headless with --data-parallel-size-local 0 runs nothing",
                "give this node --data-parallel-size-local 1 or more",
            )
        if self.multi_node and not self.address:
            raise ConfigError(
                f"{self._flags()} places replicas on several nodes, but no head address is given",
                "add --data-parallel-address set to the head's IP address (the same on every node)",
            )
        if not 0 < self.port < 65536:
            raise ConfigError(
                f"--data-parallel-rpc-port must be a TCP port, got {self.port}",
                f"use a free port, e.g. {DEFAULT_RPC_PORT}",
            )

    @property
    def local(self) -> int:
        return self.size if self.size_local is None else self.size_local

    @property
    def first_rank(self) -> int:
        return self.start_rank or 0

    @property
    def port(self) -> int:
        return DEFAULT_RPC_PORT if self.rpc_port is None else self.rpc_port

    @property
    def multi_node(self) -> bool:
        """Replicas on other nodes: the head listens for them, or this node joins a head."""
        return self.headless or self.local < self.size

    @property
    def local_ranks(self) -> list[int]:
        """The data-parallel ranks of this node's replicas."""
        return list(range(self.first_rank, self.first_rank + self.local))

    @property
    def remote_ranks(self) -> list[int]:
        """On the head: the ranks that --headless nodes bring."""
        return [] if self.headless else list(range(self.local, self.size))

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if self.address and ":" in self.address else self.address
        return f"{host}:{self.port}"

    def headless_argv(self, start_rank: int, size_local: int) -> list[str]:
        """The data-parallel flags of a --headless node that runs `size_local` replicas from
        `start_rank` (for hints)."""
        return [
            "-dp", str(self.size), "--data-parallel-size-local", str(size_local),
            "--data-parallel-start-rank", str(start_rank),
            "--data-parallel-address", str(self.address),
            "--data-parallel-rpc-port", str(self.port), "--headless",
        ]  # fmt: skip

    def _flags(self) -> str:
        if self.headless:
            return "--headless with --data-parallel-size"
        return f"--data-parallel-size-local {self.local} of --data-parallel-size {self.size}"
