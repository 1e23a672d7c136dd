"""How the nodes of an mp group (--nnodes) find each other, without Ray.

Node 0 runs the engine (the API, the scheduler, the executor: the driver of every rank's step)
and ranks ranks.node_ranks(0, ...). It listens on master_addr:master_port + 1 (the executor's
port); torch.distributed's own rendezvous is tcp://master_addr:master_port, hosted by global
rank 0 (a worker of node 0). Every other node runs `llmctl serve --headless`, a NodeAgent
(executor/node_agent.py) that connects here, then opens one connection per local rank and starts
a worker process on each. From then on node 0 drives a remote worker exactly as a local one:
multiproc.py's worker protocol over TCP instead of a socketpair, and each node's workers keep
their own environment (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, ...).

Every connection opens with the join protocol (engine/distributed/join.py): node 0 and the
agent prove to each other that they hold the cluster secret, before either reads anything else.
Then one JSON line each way:

    agent -> node 0   {"llmctl": PROTOCOL, "kind": "node", "node_rank": R, "nnodes": N,
                       "tp": T, "pp": P, "host": H, "pid": PID, "threads": K}     control conn
    node 0 -> agent   {"ok": true, "token": TOKEN}  |  {"ok": false, "error": MSG, "hint": HINT}
    agent -> node 0   {"llmctl": PROTOCOL, "kind": "rank", "node_rank": R, "rank": G,
                       "token": TOKEN}                                  one conn per local rank
    node 0 -> agent   {"ok": true}  |  {"ok": false, ...}

then multiprocessing Connection frames (4-byte length, pickle):

    control conn      node 0 -> agent  ("shutdown", reason | None)   the group ends
                      agent -> node 0  ("exited", rank, pid, returncode)
                                       ("state", rank, pid, "T" | "t" | "Z" | None)  a worker
                                        that cannot run (stopped, ...), or None: it runs again
    rank conns        multiproc.py's worker protocol (job, calls, results)

The token ties a node's rank connections to its control connection (both authenticated).

Why one connection per remote rank, handed to its worker: node 0's executor keeps one code path
for every rank (its calls, replies, timeouts and errors unchanged), nothing relays or re-frames
a step's bytes on the way (an agent relay would add a hop and a thread per rank), and a dead rank
or node is seen at once as its connection's end. A Gloo broadcast of the step inputs would
instead block a node's ranks in a collective until torch.distributed's timeout when a peer dies,
and would need a second, Python-object channel for the replies anyway.

A node rank that already joined is refused, naming it; so is a node started with another
--nnodes, -tp or -pp. The listener stays open while the group runs, so a late duplicate is
refused too, not left waiting. A peer that fails the join protocol is dropped, and named in the
error when the nodes node 0 waits for never join.
"""

from __future__ import annotations

import errno
import logging
import secrets
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from llmctl.engine.distributed import ranks
from llmctl.engine.distributed.join import ClusterSecret, JoinListener, accept, refuse
from llmctl.engine.errors import RendezvousError, RendezvousTimeoutError

logger = logging.getLogger("llmctl")

PROTOCOL = 1
_POLL_S = 0.1


def executor_port(master_port: int) -> int:
    return master_port + 1


def init_method(master_addr: str, master_port: int) -> str:
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return f"tcp://{host}:{master_port}"


# -- node 0 ------------------------------------------------------------------------------------


@dataclass
class RemoteNode:
    """A node that joined: its agent's control connection and one connection per rank."""

    node_rank: int
    host: str
    pid: int
    threads: int
    ranks: list[int]
    token: str
    control: Connection
    rank_conns: dict[int, Connection] = field(default_factory=dict)
    exited: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (pid, code)
    # rank -> (pid, /proc state letter) of its workers that cannot run, as the agent reports them
    stopped: dict[int, tuple[int, str]] = field(default_factory=dict)
    lost: bool = False  # the agent's connection ended

    @property
    def complete(self) -> bool:
        return len(self.rank_conns) == len(self.ranks)

    def describe(self) -> str:
        return f"node {self.node_rank} (host {self.host}, agent pid {self.pid})"

    def read_events(self, timeout: float = 0.0) -> None:
        """Take in what the agent reported: its workers' exits and states, or its connection's
        end."""
        while not self.lost:
            try:
                if not self.control.poll(timeout):
                    return
                message = self.control.recv()
            except (EOFError, OSError):
                self.lost = True
                return
            if message[0] == "exited":
                _, rank, pid, code = message
                self.exited[rank] = (pid, code)
            elif message[0] == "state":
                _, rank, pid, state = message
                if state is None:
                    self.stopped.pop(rank, None)
                else:
                    self.stopped[rank] = (pid, state)
            timeout = 0.0

    def end(self, reason: str | None) -> None:
        try:
            self.control.send(("shutdown", reason))
        except OSError:
            pass

    def wait_closed(self, deadline: float) -> None:
        """Until the agent closes its connection (its workers stopped), or the deadline."""
        while not self.lost and time.monotonic() < deadline:
            self.read_events(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        for conn in [self.control, *self.rank_conns.values()]:
            conn.close()


class RemoteWorker:
    """A rank on another node, where multiproc keeps a local rank's Popen."""

    def __init__(self, node: RemoteNode, rank: int) -> None:
        self.node = node
        self.rank = rank
        self.pid: int | None = None  # from its "ready" message

    @property
    def returncode(self) -> int | None:
        exit = self.node.exited.get(self.rank)
        return None if exit is None else exit[1]

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.returncode is None and not self.node.lost:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            self.node.read_events(min(_POLL_S, remaining))
        return self.returncode


class NodeListener:
    """Node 0's side: checks the master address and ports, then accepts nodes in a thread,
    each proving it holds the cluster secret (engine/distributed/join.py)."""

    def __init__(self, parallel_config) -> None:
        pc = self.pc = parallel_config
        secret = ClusterSecret.load(
            pc.cluster_secret_file, pc.insecure_join, needed_by=f"--nnodes {pc.nnodes}"
        )
        self.address = f"{pc.master_addr}:{executor_port(pc.master_port)}"
        self.nodes: dict[int, RemoteNode] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._listener = JoinListener(_bind_master(pc), secret, self._on_hello, "llmctl-rendezvous")

    def wait_for_nodes(self) -> dict[int, RemoteNode]:
        """Every other node, joined with all its ranks; RendezvousTimeoutError past the timeout
        names the nodes (and their global ranks) that did not."""
        pc = self.pc
        expected = set(range(1, pc.nnodes))
        deadline = time.monotonic() + pc.rendezvous_timeout
        logger.info(
            "Waiting up to %g s for node rank(s) %s to join at %s (llmctl serve ... --headless)",
            pc.rendezvous_timeout,
            sorted(expected),
            self.address,
        )
        while True:
            with self._lock:
                for node in list(self.nodes.values()):
                    node.read_events()
                    if node.lost:  # left before the group started: it may join again
                        logger.warning("%s left before the group started", node.describe())
                        node.close()
                        del self.nodes[node.node_rank]
                joined = {r for r, node in self.nodes.items() if node.complete}
                if joined == expected:
                    return dict(self.nodes)
            if time.monotonic() > deadline:
                missing = sorted(expected - joined)
                raise self._timeout(missing)
            time.sleep(_POLL_S)

    def _timeout(self, missing: list[int]) -> RendezvousTimeoutError:
        pc = self.pc
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        missing_ranks = [g for r in missing for g in ranks.node_ranks(r, pc.nnodes, pp, tp)]
        spans = ", ".join(
            f"node {r}: ranks {ranks.span(ranks.node_ranks(r, pc.nnodes, pp, tp))}" for r in missing
        )
        refused = "; ".join(f"{host}: {why}" for host, why in self._listener.refused.items())
        return RendezvousTimeoutError(
            f"node rank(s) {missing} did not join node 0 at {self.address} within "
            f"{pc.rendezvous_timeout:g} s (global ranks missing: {spans})"
            + (f"; connections refused: {refused}" if refused else ""),
            f"on each, run `llmctl serve MODEL -tp {tp} -pp {pp} --nnodes {pc.nnodes} "
            f"--node-rank R --master-addr {pc.master_addr} --master-port {pc.master_port} "
            "--headless` with the cluster's secret; check it reaches that address, or raise "
            "--rendezvous-timeout",
            missing_node_ranks=tuple(missing),
            missing_ranks=tuple(missing_ranks),
        )

    def close(self) -> None:
        """Accept no more nodes (the joined ones are the executor's to end)."""
        self._closed = True
        self._listener.close()

    def _on_hello(self, sock: socket.socket, hello: dict, peer: str) -> None:
        """A peer that proved it holds the cluster secret said hello."""
        if hello.get("llmctl") != PROTOCOL:
            return refuse(
                sock,
                f"a node speaking another llmctl rendezvous protocol ({hello.get('llmctl')!r}, "
                f"node 0's is {PROTOCOL}) connected from {peer}",
                "run the same llmctl version on every node",
            )
        if hello.get("kind") == "node":
            self._join_node(sock, hello)
        elif hello.get("kind") == "rank":
            self._join_rank(sock, hello)
        else:
            sock.close()

    def _join_node(self, sock: socket.socket, hello: dict) -> None:
        pc = self.pc
        r, host = int(hello["node_rank"]), str(hello.get("host", "?"))
        theirs = (hello.get("nnodes"), hello.get("tp"), hello.get("pp"))
        ours = (pc.nnodes, pc.tensor_parallel_size, pc.pipeline_parallel_size)
        if theirs != ours:
            return refuse(
                sock,
                f"node {r} (host {host}) was started with --nnodes {theirs[0]} -tp {theirs[1]} "
                f"-pp {theirs[2]}, node 0 with --nnodes {ours[0]} -tp {ours[1]} -pp {ours[2]}",
                "give every node the same --nnodes, -tp and -pp",
            )
        if not 1 <= r < pc.nnodes:
            return refuse(
                sock,
                f"node rank {r} is node 0's own rank (the node that serves the API)"
                if r == 0
                else f"node rank {r} is not a node of --nnodes {pc.nnodes}",
                f"give the other nodes --node-rank 1 to {pc.nnodes - 1}, each its own",
            )
        with self._lock:
            other = self.nodes.get(r)
            if other is not None or self._closed:
                if other is None:
                    return refuse(sock, "node 0's group is closed", "start node 0 again")
                return refuse(
                    sock,
                    f"node rank {r} has already joined node 0's group (from host {other.host}, "
                    f"agent pid {other.pid}); this node (host {host}) is refused",
                    f"give each node its own --node-rank from 1 to {pc.nnodes - 1}",
                )
            token = secrets.token_hex(16)
            accept(sock, token=token)
            node_ranks = ranks.node_ranks(r, pc.nnodes, ours[2], ours[1])
            self.nodes[r] = RemoteNode(
                node_rank=r,
                host=host,
                pid=int(hello.get("pid", 0)),
                threads=max(1, int(hello.get("threads", 1))),
                ranks=node_ranks,
                token=token,
                control=Connection(sock.detach()),
            )
        logger.info(
            "Node %d joined from host %s (agent pid %s): global ranks %s",
            r,
            host,
            hello.get("pid"),
            ranks.span(node_ranks),
        )

    def _join_rank(self, sock: socket.socket, hello: dict) -> None:
        r, rank = int(hello["node_rank"]), int(hello["rank"])
        with self._lock:
            node = self.nodes.get(r)
            if (
                node is None
                or not secrets.compare_digest(str(hello.get("token")), node.token)
                or rank not in node.ranks
                or rank in node.rank_conns
            ):
                return refuse(sock, f"rank {rank} of node {r} is not expected", None)
            accept(sock)
            node.rank_conns[rank] = Connection(sock.detach())


def _bind_master(pc) -> socket.socket:
    """Check node 0 can host the rendezvous (master_addr is its own, both ports free) and bind
    the executor's port; the typed error names the address or port and what to change."""
    addr, host = pc.master_addr, socket.gethostname()
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise RendezvousError(
            f"--master-addr {addr} does not resolve on node 0 (host {host}): {exc.strerror}",
            "give every node --master-addr set to node 0's IP address",
        ) from None
    ip = sockaddr[0]
    if ip in ("0.0.0.0", "::"):
        raise RendezvousError(
            f"--master-addr {addr} is no address other nodes can connect to",
            "give every node --master-addr set to node 0's IP address on the nodes' network",
        )
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # torch.distributed's port: global rank 0 listens there once started
        probe.bind((ip, pc.master_port))
    except OSError as exc:
        raise _bind_error(exc, pc, pc.master_port, "torch.distributed's rendezvous") from None
    finally:
        probe.close()
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = executor_port(pc.master_port)
    try:
        sock.bind((ip, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise _bind_error(exc, pc, port, "the executor's, --master-port + 1") from None
    return sock


def _bind_error(exc: OSError, pc, port: int, what: str) -> RendezvousError:
    host = socket.gethostname()
    if exc.errno == errno.EADDRNOTAVAIL:
        return RendezvousError(
            f"--master-addr {pc.master_addr} is not an address of node 0 (host {host}), which "
            "hosts the rendezvous",
            "start node 0 on the host that has this address, or give every node --master-addr "
            "set to one of this host's addresses that the other nodes reach",
        )
    if exc.errno == errno.EADDRINUSE:
        return RendezvousError(
            f"port {port} ({what}) is already in use on node 0 ({pc.master_addr}:{port}), "
            f"which --master-port {pc.master_port} asks for",
            f"choose a free --master-port on every node (llmctl uses it and the port after it), "
            f"or stop what listens there (`ss -ltnp 'sport = :{port}'`)",
        )
    return RendezvousError(
        f"node 0 (host {host}) cannot listen on {pc.master_addr}:{port} ({what}): {exc}",
        "choose another --master-port or --master-addr",
    )
