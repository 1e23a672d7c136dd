"""MultiprocExecutor: one worker process per rank on this node.

Workers are fresh interpreters (`python -m llmctl.engine.executor.multiproc --fd N`), not
multiprocessing children, so a user's script is never re-imported in them (no `if __name__ ==
"__main__"` guard needed). Each gets one end of a socketpair, wrapped in a multiprocessing
Connection, which frames and pickles each message; calls are pickled once and the same bytes sent
to every worker:

    engine -> worker   ("job", engine_config, rank, init_method, num_threads)   first, once
                       (its hf_config an HFConfigView: no transformers import in the worker)
                       ("call", call_id, method, args, kwargs)  |  ("shutdown",)
                       (method: a Worker method's name, or a function given the worker)
    worker -> engine   ("ready", rank, pid)                      once the model is loaded
                                                                 (bare workers: once started)
                       ("init_error", rank, exception, traceback)
                       ("result", call_id, value)  |  ("error", call_id, exception, traceback)

A worker answers calls in the order they were sent. A reader thread in each worker drains its
pipe into a queue, so the engine's sends never wait for a busy worker: no deadlock between a
large call and a large reply. The engine waits on the replies and on the processes' sentinels
together, so a worker that dies (killed, out of memory) is noticed at once; the engine then stops
every worker and raises EngineDeadError naming the rank. Workers die with the engine process
(PR_SET_PDEATHSIG) and ignore Ctrl-C, which the engine handles.

Across nodes (--nnodes N, without Ray), this engine is node 0's: it runs its own ranks as above
and waits for the other nodes' agents (`llmctl serve --headless`, engine/distributed/
rendezvous.py), each of which hands it one TCP connection per rank, already attached to that
rank's worker process there. The protocol on those is the one above; a remote rank's death is
seen as its connection's end or its agent's report ("exited"), in place of a pidfd.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from llmctl.engine import envs, platform
from llmctl.engine.config.hf_config_view import for_workers
from llmctl.engine.core.stall_monitor import StalledRanks, stopped_processes
from llmctl.engine.distributed import ranks, rendezvous
from llmctl.engine.distributed.ports import free_port
from llmctl.engine.distributed.rendezvous import NodeListener, RemoteWorker
from llmctl.engine.errors import (
    ConfigError,
    EngineDeadError,
    LLMCtlError,
    WorkerError,
    WorkerTimeoutError,
)
from llmctl.engine.executor.base import Executor, run_method

logger = logging.getLogger("llmctl")

_POLL_S = 0.5
_SHUTDOWN_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until its end, then raise
    KeyboardInterrupt: sends of one call to every rank, and one message's read, are not cut.
    Only in the main thread with Python's default handler (a handler of the caller is left)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is unresponsive"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


class _PendingCall:
    def __init__(self, executor: MultiprocExecutor, call_id: int) -> None:
        self.executor = executor
        self.call_id = call_id

    def result(self, timeout: float | None = None) -> list[Any]:
        return self.executor._collect(self.call_id, timeout)


class MultiprocExecutor(Executor):
    def _init_executor(self, progress) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        local = ranks.node_ranks(0, pc.nnodes, pp, tp)  # this node's (node 0's) ranks
        init_method = f"tcp://127.0.0.1:{free_port()}"
        if pc.expert_parallel_across_dp:  # the replicas' workers meet in one world
            from llmctl.engine.dp.lockstep import register_executor

            init_method = f"tcp://127.0.0.1:{pc.data_parallel_master_port}"
            register_executor(pc.data_parallel_master_port, self)
        # Every local rank of every data-parallel replica gets its own share of the cores.
        threads = max(1, len(os.sched_getaffinity(0)) // (len(local) * pc.data_parallel_size))
        # Per rank: a local Popen, or a RemoteWorker on another node.
        self.processes: list[subprocess.Popen | RemoteWorker] = []
        self.conns: list[Connection] = []
        # Readable once the rank is gone: its pidfd, or its node's agent connection.
        self.sentinels: list[int | Connection] = []
        self.listeners: list[NodeListener] = []  # across nodes: node 0's rendezvous
        self._stop_reason: list[str] = []  # told to the other nodes' agents when the group ends
        self._waiting_on: frozenset[int] = frozenset()  # ranks the engine waits for (_collect)
        # Runs at shutdown(), garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(
            self,
            _stop_workers,
            self.processes,
            self.conns,
            self.sentinels,
            self.listeners,
            self._stop_reason,
        )
        job_config = for_workers(self.engine_config)  # workers need not import transformers
        try:
            nodes = {}
            if pc.nnodes > 1:
                self.listeners.append(NodeListener(pc))
                nodes = self.listeners[0].wait_for_nodes()
                init_method = rendezvous.init_method(pc.master_addr, pc.master_port)
            for rank in range(self.world_size):
                if rank in local:
                    conn = self._start_local(rank)
                    rank_threads = threads
                else:
                    node = nodes[ranks.node_of(rank, pc.nnodes, pp, tp)]
                    conn = node.rank_conns[rank]
                    self.processes.append(RemoteWorker(node, rank))
                    self.sentinels.append(node.control)
                    self.conns.append(conn)
                    rank_threads = node.threads
                conn.send(("job", job_config, rank, init_method, rank_threads))
            self._next_call_id = 0
            self._replies: list[dict[int, tuple]] = [{} for _ in range(self.world_size)]
            self._wait_ready(progress)
        except BaseException as exc:
            self._stop_reason.append(getattr(exc, "message", None) or repr(exc))
            self.shutdown()
            raise
        self.pids = [p.pid for p in self.processes]
        # Bare workers (no model) are a tool's (llmctl doctor), which reports them itself.
        log = logger.info if self.engine_config.model_config is not None else logger.debug
        log(
            "Started %d worker processes (tp=%d, pp=%d%s), pids %s",
            self.world_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            f", {pc.nnodes} nodes" if pc.nnodes > 1 else "",
            self.pids,
        )

    def _start_local(self, rank: int) -> Connection:
        parent_end, child_end = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, "--fd", str(child_end.fileno())],
            pass_fds=[child_end.fileno()],
            stdin=subprocess.DEVNULL,
        )
        child_end.close()
        self.processes.append(process)
        self.sentinels.append(os.pidfd_open(process.pid))
        conn = Connection(parent_end.detach())
        self.conns.append(conn)
        return conn

    def _wait_ready(self, progress) -> None:
        pending = set(range(self.world_size))
        limit = self.start_timeout_s or envs.LLMCTL_WORKER_START_TIMEOUT
        deadline = time.monotonic() + limit
        while pending:
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(
                    f"worker ranks {sorted(pending)} did not load the model within {limit:g} s",
                    "check the worker logs; raise LLMCTL_WORKER_START_TIMEOUT for huge models",
                    pending_ranks=tuple(sorted(pending)),
                )
            for rank in self._ready_or_dead(pending):
                try:
                    message = self.conns[rank].recv()
                except (EOFError, OSError):
                    self._fail(rank)
                if message[0] == "init_error":
                    _, _, exc, trace = message
                    logger.debug("worker rank %d failed to start:\n%s", rank, trace)
                    if isinstance(exc, LLMCtlError):
                        raise exc
                    raise EngineDeadError(
                        f"worker rank {rank} failed to start: {type(exc).__name__}: {exc}",
                        "run with --debug (or logging at DEBUG) for the worker's traceback",
                    )
                if isinstance(self.processes[rank], RemoteWorker):
                    self.processes[rank].pid = message[2]
                pending.discard(rank)
                if progress:
                    progress(self.world_size - len(pending), self.world_size, "starting workers")

    def _ready_or_dead(self, ranks: set[int], poll_s: float = _POLL_S) -> list[int]:
        """Ranks among `ranks` with a message waiting; raises if one of them died (or abort()
        was called)."""
        self._raise_if_aborted()
        conns = {self.conns[r]: r for r in ranks}
        sentinels: dict[int | Connection, list[int]] = {}  # a node's agent watches several
        for r in ranks:
            sentinels.setdefault(self.sentinels[r], []).append(r)
        ready = wait(list(conns) + list(sentinels), timeout=poll_s)
        with_message = [conns[c] for c in ready if c in conns]
        for obj in ready:
            if obj in sentinels:
                for rank in self._gone(sentinels[obj]):
                    if rank not in with_message:
                        self._fail(rank)
        return with_message

    def _gone(self, ranks: list[int]) -> list[int]:
        """Of ranks whose sentinel is readable, those that are gone: a local pidfd is readable
        only then; a node's agent connection also carries the exits it reports."""
        remote = [self.processes[r] for r in ranks if isinstance(self.processes[r], RemoteWorker)]
        if not remote:
            return ranks
        remote[0].node.read_events()
        return [w.rank for w in remote if w.returncode is not None or w.node.lost]

    def check_alive(self) -> None:
        """Also notices a worker that died while the engine was idle (its sentinel is readable),
        without a call to it: raises WorkerError naming the rank."""
        super().check_alive()
        by_sentinel: dict[int | Connection, list[int]] = {}
        for rank, sentinel in enumerate(self.sentinels):
            by_sentinel.setdefault(sentinel, []).append(rank)
        for sentinel in wait(list(by_sentinel), timeout=0):
            for rank in self._gone(by_sentinel[sentinel]):
                self._fail(rank)

    def collective_rpc_async(
        self, method: str | Callable, args: tuple = (), kwargs: dict | None = None
    ) -> _PendingCall:
        self.check_alive()
        call_id = self._next_call_id
        self._next_call_id += 1
        payload = pickle.dumps(("call", call_id, method, args, kwargs or {}))
        with _ctrl_c_deferred():  # every rank gets the call, or a collective waits forever
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(payload)
                except OSError:
                    self._fail(rank)
        return _PendingCall(self, call_id)

    def _collect(self, call_id: int, timeout: float | None = None) -> list[Any]:
        missing = {r for r in range(self.world_size) if call_id not in self._replies[r]}
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return self._collect_missing(call_id, missing, deadline, timeout)
        finally:
            self._waiting_on = frozenset()

    def _collect_missing(
        self, call_id: int, missing: set[int], deadline: float | None, timeout: float | None
    ) -> list[Any]:
        while missing:
            self._waiting_on = frozenset(missing)
            poll_s = _POLL_S
            if deadline is not None:
                poll_s = min(poll_s, deadline - time.monotonic())
                if poll_s <= 0:
                    self._time_out(missing, timeout)
            for rank in self._ready_or_dead(missing, poll_s):
                try:
                    with _ctrl_c_deferred():  # a message read in part would break the stream
                        message = self.conns[rank].recv()
                except (EOFError, OSError):
                    self._fail(rank)
                kind, reply_id = message[0], message[1]
                if kind == "error":
                    _, _, exc, trace = message
                    if isinstance(exc, ConfigError):  # bad input a worker found (GPU memory)
                        logger.debug("worker rank %d raised:\n%s", rank, trace)
                        self._stop_reason.append(exc.message)
                        self.is_dead = True
                        self.shutdown()
                        raise exc
                    logger.error("worker rank %d raised:\n%s", rank, trace)
                    self._fail(rank, f"raised {type(exc).__name__}: {exc}")
                self._replies[rank][reply_id] = message[2]
                if reply_id == call_id:
                    missing.discard(rank)
        return [self._replies[r].pop(call_id) for r in range(self.world_size)]

    def _fail(self, rank: int, what: str | None = None) -> None:
        self._raise_if_aborted()  # a worker killed by abort(): its error, not the signal
        process = self.processes[rank]
        remote = isinstance(process, RemoteWorker)
        try:
            process.wait(timeout=1.0 if remote else 0.1)  # a remote exit comes by its agent
        except subprocess.TimeoutExpired:
            pass
        if remote and what is None and process.returncode is None:
            what = f"lost its node: {process.node.describe()} closed its connection"
        what = what or describe_exit(process.returncode)
        self.is_dead = True
        error = self._worker_error(rank, what)
        self._stop_reason.append(error.message)
        # The other ranks may be waiting for this one in a collective (the shared-memory
        # all-reduce waits up to 300 s), where no graceful shutdown reaches them: stopped at once,
        # as abort() does, instead of after _stop_workers' 5 s grace.
        self._kill_workers()
        self.shutdown()
        raise error

    def _worker_error(self, rank: int, what: str) -> WorkerError:
        process = self.processes[rank]
        remote = isinstance(process, RemoteWorker)
        where = f"pid {process.pid}"
        if remote:
            where = f"{where} on node {process.node.node_rank}, host {process.node.host}"
        machine = f"node {process.node.node_rank}'s" if remote else "the machine's"
        return WorkerError(
            f"worker rank {rank} ({where}) {what}; the engine stopped all workers",
            f"check {machine} memory (a killed worker is often the OOM killer: dmesg) and log, "
            "then start the engine again" + (" (the --headless nodes first)" if remote else ""),
            rank=rank,
            reason=what,
        )

    def _time_out(self, missing: set[int], timeout: float) -> None:
        self.is_dead = True
        self._stop_reason.append(f"worker ranks {sorted(missing)} did not answer in time")
        self.shutdown()
        raise WorkerTimeoutError(
            f"worker ranks {sorted(missing)} did not answer within {timeout:g} s; the engine "
            "stopped all workers",
            "check the machine's load, or allow more time",
            pending_ranks=tuple(sorted(missing)),
        )

    def stalled_ranks(self) -> StalledRanks:
        """Local ranks' states from /proc; another node's, as its agent reported them (a pid
        there is no pid here)."""
        local, remote = [], []
        for rank, process in enumerate(self.processes):
            if isinstance(process, RemoteWorker):
                if (stopped := process.node.stopped.get(rank)) is not None:
                    remote.append((rank, *stopped))
            else:
                local.append((rank, process.pid))
        stopped = sorted(stopped_processes(local) + tuple(remote))
        return StalledRanks(tuple(sorted(self._waiting_on)), tuple(stopped))

    def abort(self, error: EngineDeadError) -> None:
        self._stop_reason.append(error.message)  # told to the other nodes' agents: a failure
        super().abort(error)

    def _kill_workers(self) -> None:
        for process in list(self.processes):
            if isinstance(process, RemoteWorker):
                continue  # its pid is on another node: its agent stops it when the group ends
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    # SIGKILL ends a stopped process too; SIGCONT first, so that none stays stopped
                    # should the kill fail.
                    os.kill(process.pid, signal.SIGCONT)
                    process.kill()

    def shutdown(self) -> None:
        self._finalizer()


def _stop_workers(
    processes: list,
    conns: list[Connection],
    sentinels: list,
    listeners: list[NodeListener],
    reason: list[str],
) -> None:
    shutdown = pickle.dumps(("shutdown",))
    for conn in conns:
        try:
            conn.send_bytes(shutdown)
        except OSError:
            pass
    # Other nodes: no more joins; every agent that joined (the group started or not) is told the
    # group ended, and why when it failed; it then stops its workers and closes its connection.
    for listener in listeners:
        listener.close()
    nodes = [node for listener in listeners for node in listener.nodes.values()]
    for node in nodes:
        node.end(reason[0] if reason else None)
    deadline = time.monotonic() + _SHUTDOWN_GRACE_S
    local = [p for p in processes if isinstance(p, subprocess.Popen)]
    for process in local:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
    for process in local:
        try:
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for node in nodes:
        node.wait_closed(deadline + 1.0)
        node.close()
    listeners.clear()
    for conn in conns:
        conn.close()
    for fd in sentinels:
        if isinstance(fd, int):
            os.close(fd)
    sentinels.clear()


# -- the worker process ------------------------------------------------------------------------


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _read_calls(conn: Connection, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            inbox.put(conn.recv_bytes())
        except (EOFError, OSError):
            inbox.put(None)  # the engine is gone
            return


def _worker_main(fd: int) -> None:
    platform.passive_openmp_waits()  # before torch loads libgomp (unpickling the job does)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    _, engine_config, rank, init_method, threads = conn.recv()
    import torch

    # its device on its node; data-parallel replica r uses devices r * ranks_per_node and up
    pc = engine_config.parallel_config
    local_rank = pc.data_parallel_rank * pc.ranks_per_node + rank % pc.ranks_per_node

    from llmctl.engine.worker.worker import Worker

    torch.set_num_threads(threads)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_calls, args=(conn, inbox), daemon=True).start()
    try:
        worker = Worker(engine_config, rank, local_rank, distributed_init_method=init_method)
        if engine_config.model_config is not None:  # else bare: the caller runs init_device
            worker.init_device()
            worker.load_model()
    except BaseException as exc:  # report why, then exit: the engine raises it
        conn.send(("init_error", rank, _picklable(exc), traceback.format_exc()))
        return
    platform.freeze_startup_heap()  # (this process ends with the engine)
    conn.send(("ready", rank, os.getpid()))
    while True:
        raw = inbox.get()
        if raw is None:
            break
        message = pickle.loads(raw)
        if message[0] == "shutdown":
            break
        _, call_id, method, args, kwargs = message
        try:
            reply = ("result", call_id, run_method(worker, method, args, kwargs))
        except BaseException as exc:
            reply = ("error", call_id, _picklable(exc), traceback.format_exc())
        conn.send(reply)
    worker.shutdown()


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="llmctl worker process (started by the engine)")
    parser.add_argument("--fd", type=int, required=True)
    _worker_main(parser.parse_args().fd)
    # Everything the worker holds is released by its shutdown(); the interpreter's own teardown
    # of torch's modules takes seconds (2-4 s on 2 busy cores), which every stop and Ctrl-C
    # would wait for. Flush what was printed, then leave.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
