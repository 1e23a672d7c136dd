"""DPJoinServer: the head's side of multi-node data parallel: replicas of other nodes join here.

The head (`llmctl serve -dp N --data-parallel-size-local L --data-parallel-address A`) runs the
API server, the router and replicas 0 .. L-1; it listens on A:--data-parallel-rpc-port for the
others. Each --headless node (engine/dp/replica_server.py) opens one connection per replica it
runs, then builds that replica's engine; the head drives it through a RemoteReplica
(engine/dp/remote_replica.py), which the router treats as a local AsyncLLM.

Handshake, per replica: the join protocol first (engine/distributed/join.py: the node and the
head prove to each other that they hold the cluster secret, before either reads anything else),
then one JSON line each way:

    node -> head   {"llmctl": PROTOCOL, "kind": "dp_replica", "dp_rank": R, "dp_size": N,
                    "tp": T, "pp": P, "model": NAME, "host": H, "pid": PID}
    head -> node   {"ok": true}  |  {"ok": false, "error": MSG, "hint": HINT}

then multiprocessing Connection frames (4-byte length, pickle), one replica per connection:

    node -> head   ("ready", report)             its engine is built (report: see below)
                   ("failed", error)             building it raised `error`
                   ("accepted", request_id)      the engine took the request
                   ("output", request_id, RequestOutput)
                   ("error", request_id, error)  refused (InvalidRequestError) or failed
                   ("report", report)            every REPORT_INTERVAL_S: stats and health,
                                                 and before each request's last output
    head -> node   ("add", request_id, prompt, SamplingParams)
                   ("abort", request_id)
                   ("shutdown", reason | None)   stop the replica; the node closes the connection

    report = {"stats": EngineStats, "error": EngineDeadError | None, "health": dict,
              "seconds_waiting": float, "stalled": bool, "restarts": int}

A rank is refused, naming who holds it, when it is one of the head's own or already joined (the
listener stays open while the head serves, so a late duplicate is refused, not left waiting); so
is a node started with another --data-parallel-size, -tp, -pp or model. Replicas that have not
joined within --rendezvous-timeout are named in a DataParallelJoinTimeoutError, and so is a
joined replica whose "ready" (or "failed") has not come within --rendezvous-timeout of its join,
or of the head's own replicas being built if that came later (so a remote replica has as long as
the head's own, plus --rendezvous-timeout; a node that hangs while loading must not keep the
head from starting, or waiting, forever).

While the head serves, a remote replica whose connection was lost (its node died, was stopped,
or went silent for --stall-timeout) gives up its rank: a node started again with the same
--data-parallel-start-rank joins as at start-up, builds its engine and, once "ready" (within
--rendezvous-timeout of joining, or it is dropped and named in the log), is handed to the router
(`take_rejoined`) in place of the lost one. A rank whose replica still serves stays refused.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from llmctl.engine.config.engine_config import EngineConfig, ParallelConfig
from llmctl.engine.distributed.join import ClusterSecret, JoinListener, accept, refuse
from llmctl.engine.dp.placement import DPPlacement
from llmctl.engine.errors import (
    DataParallelJoinError,
    DataParallelJoinTimeoutError,
    LLMCtlError,
)

if TYPE_CHECKING:
    from llmctl.engine.dp.remote_replica import RemoteReplica

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
    joined_at: float = field(default_factory=time.monotonic)  # its engine is built from then

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


def replica_secret(pc: ParallelConfig) -> ClusterSecret:
    """The cluster secret the head and its --headless nodes prove to each other."""
    return ClusterSecret.load(
        pc.cluster_secret_file,
        pc.insecure_join,
        needed_by="data parallel across nodes (--data-parallel-address)",
    )


class DPJoinServer:
    """The head's listener for the replicas of other nodes, and their joins: before the head
    serves (wait_for_replicas) and while it does (a node taking a lost replica's place)."""

    def __init__(
        self,
        placement: DPPlacement,
        config: EngineConfig,
        timeout: float,
        silence_timeout: float = 0.0,
    ) -> None:
        """Bind the head's address and port (typed errors name them), then accept replicas in
        a thread until close(). `timeout`: seconds the replicas have to join, and each joined
        one to build its engine (from its join); `silence_timeout`: see RemoteReplica."""
        self.placement = placement
        self.config = config
        self.timeout = timeout
        self.silence_timeout = silence_timeout
        self.joined: dict[int, JoinedReplica] = {}
        # Once the head serves: its remote replicas by rank, the nodes joining again in place of
        # a lost one (building their engine), and those ready that the router has not taken.
        self.remote: dict[int, RemoteReplica] = {}
        self._rejoining: dict[int, JoinedReplica] = {}
        self._rejoined: dict[int, RemoteReplica] = {}
        self._engine_view = None
        self._lock = threading.Lock()
        self._closed = False
        secret = replica_secret(config.parallel_config)
        self._listener = JoinListener(_bind(placement), secret, self._on_hello, "llmctl-dp-join")
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
        from llmctl.engine.dp.remote_replica import EngineView, RemoteReplica

        try:
            joined = self._wait_joined()
            # the head's own replicas are built: a remote one has `timeout` more to be built
            built = time.monotonic()
            reports = {rank: self._wait_ready(j, built) for rank, j in sorted(joined.items())}
        except BaseException as exc:
            reason = exc.message if isinstance(exc, LLMCtlError) else repr(exc)
            self.close(reason=f"the head did not start: {reason}")
            raise
        self._engine_view = EngineView.of(self.config) if self.placement.local == 0 else None
        replicas = [
            RemoteReplica(
                joined[rank],
                reports[rank],
                self.placement.endpoint,
                self._engine_view,
                self.silence_timeout,
            )
            for rank in sorted(joined)
        ]
        with self._lock:
            self.remote = {replica.rank: replica for replica in replicas}
        return replicas

    def take_rejoined(self) -> dict[int, RemoteReplica]:
        """Replicas whose node joined again after the head lost them, and built its engine
        since the last call: rank -> its new RemoteReplica (the router's to take)."""
        with self._lock:
            rejoined, self._rejoined = self._rejoined, {}
        return rejoined

    def close(self, reason: str | None = None) -> None:
        """Accept no more replicas; with `reason`, also end those that joined (a failed start:
        running ones belong to their RemoteReplica)."""
        self._closed = True
        self._listener.close()
        with self._lock:
            # nodes joining again are not the router's yet: they stop with the head
            ending = list(self._rejoining.values()) + (
                list(self.joined.values()) if reason is not None else []
            )
            self._rejoining.clear()
            unclaimed, self._rejoined = list(self._rejoined.values()), {}
        for replica in ending:
            try:
                replica.conn.send(("shutdown", reason))
            except OSError:
                pass
            replica.conn.close()
        for remote in unclaimed:
            remote.shutdown()

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
        refused = "; ".join(f"{host}: {why}" for host, why in self._listener.refused.items())
        return DataParallelJoinTimeoutError(
            f"data-parallel replica(s) {missing} of {p.size} did not join the head at "
            f"{p.endpoint} within {self.timeout:g} s (joined: {sorted(self.joined) or 'none'}; "
            f"the head runs {p.local_ranks or 'none'})"
            + (f"; connections refused: {refused}" if refused else ""),
            f"on the other node(s) run `llmctl serve MODEL {argv}` (each node its own start "
            "rank) with the cluster's secret, check they reach that address and port, or raise "
            "--rendezvous-timeout",
            missing_replicas=tuple(missing),
        )

    def _wait_ready(self, replica: JoinedReplica, since: float = 0.0) -> dict:
        """Until the node has built the replica's engine (its "ready" report), for at most
        `timeout` seconds from its join or `since` (the head's own replicas built), whichever
        is later (DataParallelJoinTimeoutError naming it)."""
        try:
            if replica.first is None:
                start = max(replica.joined_at, since)
                remaining = start + self.timeout - time.monotonic()
                if not replica.conn.poll(max(0.0, remaining)):
                    raise self._ready_timeout(replica)
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

    def _ready_timeout(self, replica: JoinedReplica) -> DataParallelJoinTimeoutError:
        return DataParallelJoinTimeoutError(
            f"{replica.describe()} joined the head at {self.placement.endpoint} but its engine "
            f"was not built within {self.timeout:g} s (--rendezvous-timeout, counted from its "
            "join, or from when the head's own replicas were built if later): its node is still "
            "loading the model, or hangs",
            "see that node's log; if loading the model takes longer, raise --rendezvous-timeout "
            "on the head; if the node hangs, stop it and start it again",
            missing_replicas=(replica.rank,),
        )

    def _await_rejoin(self, joined: JoinedReplica) -> None:
        """A node that joined again while the head serves: wait for its engine, then hand it to
        the router (take_rejoined); on a failure or timeout, drop it and say why."""
        from llmctl.engine.dp.remote_replica import RemoteReplica

        try:
            report = self._wait_ready(joined)
        except DataParallelJoinError as exc:
            with self._lock:
                mine = self._rejoining.get(joined.rank) is joined
                if mine:
                    del self._rejoining[joined.rank]
            if mine:  # (else close() ended it)
                logger.error("%s (%s)", exc.message, exc.hint)
                try:
                    joined.conn.send(("shutdown", f"the head dropped it: {exc.message}"))
                except OSError:
                    pass
                joined.conn.close()
            return
        replica = RemoteReplica(
            joined, report, self.placement.endpoint, self._engine_view, self.silence_timeout
        )
        with self._lock:
            mine = self._rejoining.get(joined.rank) is joined
            if mine:
                del self._rejoining[joined.rank]
                self.joined[joined.rank] = joined
                self.remote[joined.rank] = replica
                self._rejoined[joined.rank] = replica
        if not mine:  # the head stopped meanwhile
            replica.shutdown()
            return
        logger.warning(
            "%s built its engine: the router sends it requests again", replica.describe()
        )

    def _holder(self, rank: int) -> JoinedReplica | None:
        """Who holds `rank` now (under the lock): a replica that joined (and has not left
        before the head started, nor been lost since), or a node joining again; None: free."""
        pending = self._rejoining.get(rank)
        if pending is not None:
            return pending
        other = self.joined.get(rank)
        if other is not None and other.left():  # its node went away before "ready"
            logger.warning("%s left before the head started", other.describe())
            other.conn.close()
            del self.joined[rank]
            return None
        remote = self.remote.get(rank)
        if remote is not None and remote.dead_error is not None:
            return None  # lost while the head serves: its node may join again
        return other

    def _on_hello(self, sock: socket.socket, hello: dict, peer: str) -> None:
        """A peer that proved it holds the cluster secret said hello."""
        if hello.get("llmctl") != PROTOCOL or hello.get("kind") != "dp_replica":
            return _refuse(
                sock,
                f"a peer at {peer} is no llmctl data-parallel replica of this version "
                f"(protocol {hello.get('llmctl')!r}, kind {hello.get('kind')!r})",
                "run the same llmctl version on every node, and give --data-parallel-rpc-port "
                "only to data-parallel nodes",
            )
        refusal = self._refusal(hello)
        if refusal is not None:
            return _refuse(sock, *refusal)
        rank, host, pid = int(hello["dp_rank"]), str(hello["host"]), int(hello["pid"])
        with self._lock:
            other = self._holder(rank)
            if other is not None or self._closed:
                if other is None:
                    return _refuse(sock, "the head accepts no more replicas", "start it again")
                return _refuse(
                    sock,
                    f"data-parallel replica rank {rank} was given twice: it already joined from "
                    f"host {other.host} (pid {other.pid}); host {host} (pid {pid}) is refused",
                    "give each node its own --data-parallel-start-rank, so that no two nodes "
                    "run the same replica (a node restarted in place of a lost one joins once "
                    "the head reports that replica dead in /health)",
                )
            accept(sock)
            joined = JoinedReplica(rank, host, pid, Connection(sock.detach()))
            again = rank in self.remote  # the head serves: in place of a lost replica
            if again:
                self._rejoining[rank] = joined
            else:
                self.joined[rank] = joined
        if again:
            logger.warning(
                "Data-parallel replica %d joined again from host %s (pid %d) in place of the "
                "lost one; waiting for its engine",
                rank,
                host,
                pid,
            )
            threading.Thread(
                target=self._await_rejoin,
                args=(joined,),
                name=f"llmctl-dp{rank}-rejoin",
                daemon=True,
            ).start()
            return
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
    refuse(sock, message, hint, what="a data-parallel replica")


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
