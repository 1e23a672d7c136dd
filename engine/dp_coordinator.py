"""DPCoordinator: the head's side of multi-node data parallel: replicas of other nodes join here.

The head (`llmctl serve -dp N --data-parallel-size-local L --data-parallel-address A`) runs the
API server, the router and replicas 0 .. L-1; it listens on A:--data-parallel-rpc-port for the
others. Each --headless node (engine/dp_replica_server.py) opens one connection per replica it
runs, then builds that replica's engine; the head drives it through a RemoteReplica
(engine/dp_remote_replica.py), which the router treats as a local AsyncLLM.

Handshake, per replica: one JSON line each way (rendezvous.send_line / recv_line: read byte by
byte, nothing is unpickled from a peer before it is accepted):

    node -> head   {"llmctl": PROTOCOL, "kind": "dp_replica", "dp_rank": R, "dp_size": N,
                    "tp": T, "pp": P, "model": NAME, "host": H, "pid": PID}
    head -> node   {"ok": true}  |  {"ok": false, "error": MSG, "hint": HINT}

then multiprocessing Connection frames (4-byte length, pickle), one replica per connection:

    node -> head   ("ready", report)             its engine is built (report: see below)
                   ("failed", error)             building it raised `error`
                   ("accepted", request_id)      the engine took the request
                   ("output", request_id, RequestOutput)
                   ("error", request_id, error)  refused (InvalidRequestError) or failed
                   ("report", report)            every REPORT_INTERVAL_S: stats and health
    head -> node   ("add", request_id, prompt, SamplingParams)
                   ("abort", request_id)
                   ("shutdown", reason | None)   stop the replica; the node closes the connection

    report = {"stats": EngineStats, "error": EngineDeadError | None, "health": dict,
              "seconds_waiting": float, "stalled": bool, "restarts": int}

A rank is refused, naming who holds it, when it is one of the head's own or already joined (the
listener stays open while the head serves, so a late duplicate is refused, not left waiting); so
is a node started with another --data-parallel-size, -tp, -pp or model. Replicas that have not
joined within --rendezvous-timeout are named in a DataParallelJoinTimeoutError. Connections are
unauthenticated, as torch.distributed's are: the port must be reachable only from the cluster's
own network.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from llmctl.engine.config import EngineConfig
from llmctl.engine.distributed import rendezvous
from llmctl.engine.dp_placement import DPPlacement
from llmctl.engine.errors import (
    DataParallelJoinError,
    DataParallelJoinTimeoutError,
    LLMCtlError,
)

logger = logging.getLogger("llmctl")

PROTOCOL = 1
REPORT_INTERVAL_S = 0.25
_POLL_S = 0.1


def replica_hello(placement: DPPlacement, config: EngineConfig, rank: int) -> dict:
    """What a --headless node says when its replica `rank` joins (checked by the head)."""
    import os

    pc = config.parallel_config
    return {
        "llmctl": PROTOCOL,
        "kind": "dp_replica",
        "dp_rank": rank,
        "dp_size": placement.size,
        "tp": pc.tensor_parallel_size,
        "pp": pc.pipeline_parallel_size,
        "model": config.model_config.served_model_name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


@dataclass
class JoinedReplica:
    """A replica of another node that joined: its connection, and where it runs."""

    rank: int
    host: str
    pid: int
    conn: Connection
    first: tuple | None = None  # its first message ("ready" or "failed"), once read

    def left(self) -> bool:
        """True when the node closed the connection before its first message; reads that
        message, when it came, into `first`."""
        if self.first is not None:
            return False
        try:
            if self.conn.poll(0):
                self.first = self.conn.recv()
        except (EOFError, OSError):
            return True
        return False

    def describe(self) -> str:
        return f"data-parallel replica {self.rank} (host {self.host}, pid {self.pid})"


class DPCoordinator:
    def __init__(
        self,
        placement: DPPlacement,
        config: EngineConfig,
        timeout: float,
        silence_timeout: float = 0.0,
    ) -> None:
        """Bind the head's address and port (typed errors name them), then accept replicas in
        a thread until close(). `timeout`: seconds the replicas have to join;
        `silence_timeout`: see RemoteReplica."""
        self.placement = placement
        self.config = config
        self.timeout = timeout
        self.silence_timeout = silence_timeout
        self.joined: dict[int, JoinedReplica] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._sock = _bind(placement)
        self._thread = threading.Thread(
            target=self._accept_loop, name="llmctl-dp-coordinator", daemon=True
        )
        self._thread.start()
        logger.info(
            "Waiting up to %g s for data-parallel replica(s) %s to join at %s "
            "(llmctl serve ... --headless)",
            timeout,
            placement.remote_ranks,
            placement.endpoint,
        )

    def wait_for_replicas(self) -> list:
        """Every remote replica joined and built, as RemoteReplicas in rank order. Raises
        DataParallelJoinTimeoutError naming the ranks that did not join in time, or the error
        a node met building its replica (the joined ones are then told to stop)."""
        from llmctl.engine.dp_remote_replica import EngineView, RemoteReplica

        try:
            joined = self._wait_joined()
            reports = {rank: self._wait_ready(j) for rank, j in sorted(joined.items())}
        except BaseException as exc:
            reason = exc.message if isinstance(exc, LLMCtlError) else repr(exc)
            self.close(reason=f"the head did not start: {reason}")
            raise
        engine = EngineView.of(self.config) if self.placement.local == 0 else None
        return [
            RemoteReplica(
                joined[rank], reports[rank], self.placement.endpoint, engine, self.silence_timeout
            )
            for rank in sorted(joined)
        ]

    def close(self, reason: str | None = None) -> None:
        """Accept no more replicas; with `reason`, also end those that joined (a failed start:
        running ones belong to their RemoteReplica)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=rendezvous.HELLO_TIMEOUT_S)
        if reason is not None:
            with self._lock:
                for replica in self.joined.values():
                    try:
                        replica.conn.send(("shutdown", reason))
                    except OSError:
                        pass
                    replica.conn.close()

    # -- internals -------------------------------------------------------------------------------

    def _wait_joined(self) -> dict[int, JoinedReplica]:
        expected = set(self.placement.remote_ranks)
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                for rank, replica in list(self.joined.items()):
                    if replica.left():
                        logger.warning("%s left before the head started", replica.describe())
                        replica.conn.close()
                        del self.joined[rank]  # it may join again
                if set(self.joined) == expected:
                    return dict(self.joined)
                missing = sorted(expected - set(self.joined))
            if time.monotonic() > deadline:
                raise self._timeout(missing)
            time.sleep(_POLL_S)

    def _timeout(self, missing: list[int]) -> DataParallelJoinTimeoutError:
        p = self.placement
        start, count = missing[0], missing[-1] - missing[0] + 1
        argv = " ".join(p.headless_argv(start, count))
        return DataParallelJoinTimeoutError(
            f"data-parallel replica(s) {missing} of {p.size} did not join the head at "
            f"{p.endpoint} within {self.timeout:g} s (joined: {sorted(self.joined) or 'none'}; "
            f"the head runs {p.local_ranks or 'none'})",
            f"on the other node(s) run `llmctl serve MODEL {argv}` (each node its own start "
            "rank), check they reach that address and port, or raise --rendezvous-timeout",
            missing_replicas=tuple(missing),
        )

    def _wait_ready(self, replica: JoinedReplica) -> dict:
        """Until the node has built the replica's engine (its "ready" report)."""
        try:
            # kept in `first`, so that left() never reads from the replica's connection again
            message = replica.first = replica.first or replica.conn.recv()
        except (EOFError, OSError):
            raise DataParallelJoinError(
                f"{replica.describe()} closed its connection to the head before its engine "
                "was built (its node stopped or died)",
                "see that node's log, then start it again",
            ) from None
        if message[0] == "failed":
            error = message[1]
            detail = error.message if isinstance(error, LLMCtlError) else str(error)
            raise DataParallelJoinError(
                f"{replica.describe()} failed to start its engine: {detail}",
                getattr(error, "hint", None) or "see that node's log",
            )
        return message[1]

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            try:
                self._handshake(sock, peer)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.debug("data parallel: dropped a connection from %s: %s", peer, exc)
                sock.close()

    def _handshake(self, sock: socket.socket, peer) -> None:
        hello = rendezvous.recv_line(sock, rendezvous.HELLO_TIMEOUT_S)
        if hello.get("llmctl") != PROTOCOL or hello.get("kind") != "dp_replica":
            return _refuse(
                sock,
                f"a peer at {peer[0]} is no llmctl data-parallel replica of this version "
                f"(protocol {hello.get('llmctl')!r}, kind {hello.get('kind')!r})",
                "run the same llmctl version on every node, and give --data-parallel-rpc-port "
                "only to data-parallel nodes",
            )
        refusal = self._refusal(hello)
        if refusal is not None:
            return _refuse(sock, *refusal)
        rank, host, pid = int(hello["dp_rank"]), str(hello["host"]), int(hello["pid"])
        with self._lock:
            other = self.joined.get(rank)
            if other is not None and other.left():  # its node went away before "ready"
                logger.warning("%s left before the head started", other.describe())
                other.conn.close()
                del self.joined[rank]
                other = None
            if other is not None or self._closed:
                if other is None:
                    return _refuse(sock, "the head accepts no more replicas", "start it again")
                return _refuse(
                    sock,
                    f"data-parallel replica rank {rank} was given twice: it already joined from "
                    f"host {other.host} (pid {other.pid}); host {host} (pid {pid}) is refused",
                    "give each node its own --data-parallel-start-rank, so that no two nodes "
                    "run the same replica",
                )
            rendezvous.send_line(sock, {"ok": True})
            rendezvous.tune(sock)
            self.joined[rank] = JoinedReplica(rank, host, pid, Connection(sock.detach()))
        logger.info("Data-parallel replica %d joined from host %s (pid %d)", rank, host, pid)

    def _refusal(self, hello: dict) -> tuple[str, str] | None:
        """Why a replica's hello is refused (message, hint); None: it may join."""
        p, config = self.placement, self.config
        pc = config.parallel_config
        rank, host = int(hello["dp_rank"]), hello.get("host", "?")
        who = f"data-parallel replica {rank} (host {host})"
        if hello.get("dp_size") != p.size:
            return (
                f"{who} was started with --data-parallel-size {hello.get('dp_size')}, the head "
                f"with {p.size}",
                "give every node the same --data-parallel-size (the replicas of all nodes)",
            )
        theirs = (hello.get("tp"), hello.get("pp"))
        ours = (pc.tensor_parallel_size, pc.pipeline_parallel_size)
        if theirs != ours:
            return (
                f"{who} was started with -tp {theirs[0]} -pp {theirs[1]}, the head with "
                f"-tp {ours[0]} -pp {ours[1]}",
                "give every node the same -tp and -pp",
            )
        model = config.model_config.served_model_name
        if hello.get("model") != model:
            return (
                f"{who} serves model {hello.get('model')!r}, the head {model!r}",
                "start every node with the same MODEL and --served-model-name",
            )
        if rank in p.local_ranks:
            return (
                f"data-parallel replica rank {rank} was given twice: the head runs replicas "
                f"{p.local_ranks[0]} to {p.local_ranks[-1]} itself; host {host} is refused",
                f"give the --headless nodes ranks {p.local} to {p.size - 1} "
                f"(--data-parallel-start-rank {p.local} on the first)",
            )
        if not 0 <= rank < p.size:
            return (
                f"{who} is no rank of --data-parallel-size {p.size} (0 to {p.size - 1})",
                "the local sizes of all nodes must add up to --data-parallel-size",
            )
        return None


def _refuse(sock: socket.socket, message: str, hint: str | None) -> None:
    logger.warning("Refused a data-parallel replica: %s", message)
    try:
        rendezvous.send_line(sock, {"ok": False, "error": message, "hint": hint})
    except OSError:
        pass
    sock.close()


def _bind(p: DPPlacement) -> socket.socket:
    """Listen on the head's --data-parallel-address:--data-parallel-rpc-port; the typed error
    names the address or port and what to change."""
    host = socket.gethostname()
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(p.address, None, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise DataParallelJoinError(
            f"--data-parallel-address {p.address} does not resolve on the head (host {host}): "
            f"{exc.strerror}",
            "give every node --data-parallel-address set to the head's IP address",
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((sockaddr[0], p.port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise DataParallelJoinError(
                f"--data-parallel-address {p.address} is not an address of the head (host "
                f"{host}), which serves the API and listens for the other nodes' replicas",
                "start the head on the host that has this address, or give every node "
                "--data-parallel-address set to one of this host's addresses",
            ) from None
        if exc.errno == errno.EADDRINUSE:
            raise DataParallelJoinError(
                f"port {p.port} (--data-parallel-rpc-port) is already in use on the head "
                f"({p.endpoint})",
                "choose a free --data-parallel-rpc-port on every node, or stop what listens "
                f"there (`ss -ltnp 'sport = :{p.port}'`)",
            ) from None
        raise DataParallelJoinError(
            f"the head (host {host}) cannot listen on {p.endpoint}: {exc}",
            "choose another --data-parallel-rpc-port or --data-parallel-address",
        ) from None
    return sock
