"""ReplicaServer: a --headless node's data-parallel replicas, served to the head's router.

    llmctl serve MODEL -dp N --data-parallel-size-local L --data-parallel-start-rank S \\
        --data-parallel-address HEAD --data-parallel-rpc-port P --headless

Each of the node's replicas S .. S+L-1 joins the head first (one connection each, protocol in
engine/dp/join_server.py), so that a rank given twice or a size the head does not share is
refused before any model loads; then the replicas' engines are built at once (as the head builds
its own, each an AsyncLLM with its engine thread and mp workers, the cores shared out among this
node's replicas) and each says "ready". From then on the head drives them: each "add" becomes a
task that streams the replica's outputs back, an "abort" cancels it (closing the stream aborts
the request), and every REPORT_INTERVAL_S the replica's stats and health go to the head. A
request's last output follows a report too: a client that got its answer and reads the head's
/metrics finds the request's tokens counted there, as a local replica's are.

The node runs until the head ends every replica ("shutdown"); when the head's connection ends
without it (the head stopped or died) the node stops its replicas and raises EngineDeadError;
SIGTERM or Ctrl-C here stops them too, and the head sees the replicas gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection

from llmctl.engine.client.async_llm import AsyncLLM
from llmctl.engine.distributed import join
from llmctl.engine.distributed.join import ClusterSecret
from llmctl.engine.dp.join_server import REPORT_INTERVAL_S, replica_hello, replica_secret
from llmctl.engine.dp.placement import DPPlacement
from llmctl.engine.errors import (
    DataParallelJoinError,
    DataParallelJoinTimeoutError,
    EngineDeadError,
    LLMCtlError,
)

logger = logging.getLogger("llmctl")


def run_dp_headless(engine_args) -> None:
    """Join the head with this node's replicas and serve them until the head ends them. Raises
    DataParallelJoinError when they cannot join, EngineDeadError when the head went away."""
    from llmctl.engine.dp.dp_async_llm import replica_configs, start_replicas

    placement = engine_args.data_parallel_placement()
    config = engine_args.create_engine_config()
    secret = replica_secret(config.parallel_config)
    deadline = time.monotonic() + engine_args.rendezvous_timeout
    conns: dict[int, Connection] = {}
    replicas: list[AsyncLLM] = []
    try:
        for rank in placement.local_ranks:
            hello = replica_hello(placement, config, rank)
            conns[rank] = join_head(
                placement, hello, engine_args.rendezvous_timeout, deadline, secret
            )
        logger.info(
            "Data-parallel replicas %s joined the head at %s; building their engines",
            placement.local_ranks,
            placement.endpoint,
        )
        try:
            replicas = start_replicas(replica_configs(config, placement.local), engine_args)
        except BaseException as exc:
            error = exc if isinstance(exc, LLMCtlError) else EngineDeadError(repr(exc))
            for conn in conns.values():
                with contextlib.suppress(OSError):
                    conn.send(("failed", error))
            raise
        servers = [
            ReplicaServer(rank, replica, conns[rank], placement)
            for rank, replica in zip(placement.local_ranks, replicas, strict=True)
        ]
        asyncio.run(_serve_all(servers))
    finally:
        for replica in replicas:
            replica.shutdown()
        for conn in conns.values():
            conn.close()


async def _serve_all(servers: list[ReplicaServer]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            logger.warning("Stopping data-parallel replicas on a signal; the head loses them")
            return
        results = await asyncio.gather(*tasks)  # each ends when its connection does
    finally:
        for task in [stopper, *tasks]:
            task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    lost = [error for error in results if error is not None]
    if lost:
        raise lost[0]


class ReplicaServer:
    """One replica on its connection to the head."""

    def __init__(
        self,
        rank: int,
        replica: AsyncLLM,
        conn: Connection,
        placement: DPPlacement,
        report_interval: float = REPORT_INTERVAL_S,
    ) -> None:
        self.rank = rank
        self.report_interval = report_interval
        self.replica = replica
        self.conn = conn
        self.placement = placement
        self._tasks: dict[str, asyncio.Task] = {}
        self._send_lock = threading.Lock()

    async def serve(self) -> EngineDeadError | None:
        """Until the head's "shutdown" (None) or the connection's end (the error)."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        threading.Thread(
            target=self._read, args=(loop, inbox), name=f"llmctl-dp{self.rank}-conn", daemon=True
        ).start()
        self._send(("ready", self._report()))
        reporter = asyncio.create_task(self._report_every(self.report_interval))
        try:
            while True:
                message = await inbox.get()
                kind = message[0]
                if kind == "add":
                    _, request_id, prompt, params = message
                    task = asyncio.create_task(self._run(request_id, prompt, params))
                    self._tasks[request_id] = task
                elif kind == "abort":
                    task = self._tasks.pop(message[1], None)
                    if task is not None:
                        task.cancel()
                elif kind == "shutdown":
                    reason = message[1]
                    if reason:  # the head failed to start (a replica of another node, ...)
                        return EngineDeadError(
                            f"the head ended data-parallel replica {self.rank}: {reason}",
                            "see the head's log for more",
                        )
                    logger.info("Data-parallel replica %d: the head ended it", self.rank)
                    return None
                elif kind == "lost":
                    return EngineDeadError(
                        f"the head at {self.placement.endpoint} closed its connection to "
                        f"data-parallel replica {self.rank} without ending it (it stopped or "
                        "died)",
                        "see the head's log; start the head again, then this node",
                    )
        finally:
            reporter.cancel()
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(reporter, *self._tasks.values(), return_exceptions=True)
            # the replica's workers stop before the head learns it ended (the connection's end)
            await asyncio.to_thread(self.replica.shutdown)
            self.conn.close()

    async def _run(self, request_id: str, prompt, params) -> None:
        try:
            stream = self.replica.generate(
                prompt, params, request_id, on_accepted=lambda: self._send(("accepted", request_id))
            )
            async with contextlib.aclosing(stream):  # closing it early aborts the request
                async for output in stream:
                    if output.finished:  # the head's stats count the request before it ends
                        self._send(("report", self._report()))
                    self._send(("output", request_id, output))
        except asyncio.CancelledError:
            pass  # the head aborted it
        except Exception as exc:
            error = exc if isinstance(exc, LLMCtlError) else EngineDeadError(repr(exc))
            self._send(("error", request_id, error))
        finally:
            self._tasks.pop(request_id, None)

    async def _report_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self._send(("report", self._report()))

    def _report(self) -> dict:
        replica = self.replica
        error = replica.health_error()
        return {
            "stats": replica.get_stats(),
            "error": error,
            "health": replica.health() if error is None else {"status": "error"},
            "seconds_waiting": replica.monitor.seconds_waiting(),
            "stalled": replica.stall_error is not None or replica.monitor.stalled(),
            "restarts": replica.restarts,
        }

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:
            pass  # the reader sees the connection's end

    def _read(self, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("lost",)
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, message)
            except RuntimeError:  # the loop is closed: the node is stopping
                return
            if message[0] in ("lost", "shutdown"):
                return


def join_head(
    placement: DPPlacement,
    hello: dict,
    timeout: float,
    deadline: float | None = None,
    secret: ClusterSecret | None = None,
) -> Connection:
    """Connect to the head, retrying for `timeout` seconds or until `deadline` (the head may
    start later), prove the cluster secret both ways (`secret`, default: the environment's;
    engine/distributed/join.py) and join with `hello`. An unreachable head ends in
    DataParallelJoinTimeoutError naming its address; a refusal in DataParallelJoinError with the
    head's reason; a secret the head does not share in ClusterSecretError."""
    address, port, rank = placement.address, placement.port, hello["dp_rank"]
    deadline = time.monotonic() + timeout if deadline is None else deadline
    where = placement.endpoint
    secret = secret or ClusterSecret.load(needed_by="data parallel across nodes")
    try:
        sock, reply = join.dial(address, port, secret, hello, deadline, f"the head at {where}")
    except join.JoinTimeoutError as exc:
        raise DataParallelJoinTimeoutError(
            f"data-parallel replica {rank} could not reach the head at {where} within "
            f"{timeout:g} s (last error: {exc.last})",
            f"start the head (llmctl serve MODEL -dp {placement.size} "
            "--data-parallel-size-local L --data-parallel-address "
            f"{address} --data-parallel-rpc-port {port}), check that --data-parallel-address "
            "is the head's address and that this node reaches that port, or raise "
            "--rendezvous-timeout",
            missing_replicas=(rank,),
        ) from None
    except socket.gaierror as exc:
        raise DataParallelJoinError(
            f"--data-parallel-address {address} does not resolve on this node (host "
            f"{socket.gethostname()}): {exc.strerror}",
            "give every node --data-parallel-address set to the head's IP address",
        ) from None
    if not reply.get("ok"):
        sock.close()
        raise DataParallelJoinError(str(reply.get("error")), reply.get("hint"))
    return Connection(sock.detach())
