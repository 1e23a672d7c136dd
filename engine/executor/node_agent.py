"""NodeAgent: a --headless node's part of an mp group across nodes (`llmctl serve --headless`).

It joins node 0 (engine/distributed/rendezvous.py: a control connection, then one connection per
local rank, each opened with the join protocol of engine/distributed/join.py: node 0 must prove
that it holds the cluster secret before anything it sends is read), starts one worker process per
local rank on that rank's connection (multiproc.py's worker: node 0 then drives it as it drives
its own), and stays until node 0 ends the group. It reports each worker's exit to node 0, and each
worker that stops running or starts again (SIGSTOP, a debugger: /proc's state), so that node 0's
/health can name a stalled rank on this node; when node 0 ends the group, or its connection ends,
or this process gets SIGTERM or Ctrl-C, it stops its workers (SIGKILL ends a stopped one too). The
workers die with it (PR_SET_PDEATHSIG), so even a killed agent leaves nothing running. The
workers keep this node's environment.

With --restart-on-failure (`run_headless(..., max_restarts=N)`), a group that ended in a failure
(node 0 ended it naming one, or node 0's connection ended) is joined again, as node 0 restarts its
engine: up to N times, each join within --rendezvous-timeout. A group node 0 ended normally
(its server stopped), or SIGTERM or Ctrl-C here, ends the agent for good.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

from llmctl.engine.config.engine_config import ParallelConfig
from llmctl.engine.core.stall_monitor import process_state, stopped_processes
from llmctl.engine.distributed import join, ranks, rendezvous
from llmctl.engine.distributed.join import ClusterSecret
from llmctl.engine.errors import EngineDeadError, RendezvousError, RendezvousTimeoutError

logger = logging.getLogger("llmctl")

_GRACE_S = 5.0
# How often worker states are read (/proc) and changes reported: node 0's stall message names
# a stopped remote rank only if the report came before --stall-timeout ran out (a few /proc
# reads a poll: nothing to save by polling less)
_POLL_S = 0.25


def run_headless(parallel_config: ParallelConfig, max_restarts: int = 0) -> None:
    """Join node 0's group and run this node's ranks until it ends; after a group that ended in
    a failure, join node 0's next one, up to `max_restarts` times. Raises RendezvousError when a
    group cannot be joined, EngineDeadError when one ended in a failure and no restart is left."""
    pc = parallel_config
    restarts = 0
    while True:
        try:
            NodeAgent(pc).run()
            return
        except EngineDeadError as exc:
            if restarts >= max_restarts:
                raise
            restarts += 1
            logger.warning(
                "Node %d: the group ended in a failure (%s); joining node 0's next group "
                "(restart %d of %d, up to %g s)",
                pc.node_rank,
                exc.message,
                restarts,
                max_restarts,
                pc.rendezvous_timeout,
            )


class NodeAgent:
    def __init__(self, parallel_config: ParallelConfig) -> None:
        pc = self.pc = parallel_config
        self.secret = node_secret(pc)
        self.ranks = ranks.node_ranks(
            pc.node_rank, pc.nnodes, pc.pipeline_parallel_size, pc.tensor_parallel_size
        )
        self.control: Connection | None = None
        self.processes: dict[int, subprocess.Popen] = {}
        self.pidfds: dict[int, int] = {}  # rank -> pidfd, while the worker runs
        self.states: dict[int, str] = {}  # rank -> the /proc state last reported, if not running

    def run(self) -> None:
        pc = self.pc
        deadline = time.monotonic() + pc.rendezvous_timeout
        stop: list[int] = []
        try:
            socks = self._join(deadline)
            previous = {
                sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)
            }
            try:
                self._start_workers(socks)
                ended = self._supervise(stop)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        except BaseException:
            self._stop_workers(grace=0.0)
            raise
        self._stop_workers(grace=_GRACE_S if ended else 0.0)

    def _join(self, deadline: float) -> dict[int, socket.socket]:
        pc = self.pc
        hello = {
            "llmctl": rendezvous.PROTOCOL,
            "kind": "node",
            "node_rank": pc.node_rank,
            "nnodes": pc.nnodes,
            "tp": pc.tensor_parallel_size,
            "pp": pc.pipeline_parallel_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "threads": max(1, len(os.sched_getaffinity(0)) // len(self.ranks)),
        }
        address = f"{pc.master_addr}:{rendezvous.executor_port(pc.master_port)}"
        logger.info(
            "Node %d: joining node 0 at %s (global ranks %s, up to %g s)",
            pc.node_rank,
            address,
            ranks.span(self.ranks),
            pc.rendezvous_timeout,
        )
        sock, reply = connect_to_master(pc, hello, deadline, self.secret)
        self.control = Connection(sock.detach())
        socks: dict[int, socket.socket] = {}
        try:
            for rank in self.ranks:
                socks[rank] = open_rank(pc, rank, reply["token"], self.secret)
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        logger.info("Node %d joined node 0 at %s", pc.node_rank, address)
        return socks

    def _start_workers(self, socks: dict[int, socket.socket]) -> None:
        from llmctl.engine.executor import multiproc

        for rank, sock in socks.items():
            with sock:
                process = subprocess.Popen(
                    [sys.executable, "-m", multiproc.__name__, "--fd", str(sock.fileno())],
                    pass_fds=[sock.fileno()],
                    stdin=subprocess.DEVNULL,
                )
            self.processes[rank] = process
            self.pidfds[rank] = os.pidfd_open(process.pid)
        logger.info(
            "Node %d: worker processes %s for global ranks %s; node 0 drives them",
            self.pc.node_rank,
            [p.pid for p in self.processes.values()],
            ranks.span(self.ranks),
        )

    def _supervise(self, stop: list[int]) -> bool:
        """Until the group ends: True when node 0 ended it; False on SIGTERM or Ctrl-C here.
        Raises EngineDeadError when node 0 ended it in a failure, or went away."""
        pc = self.pc
        while not stop:
            by_fd = {fd: rank for rank, fd in self.pidfds.items()}
            ready = wait([self.control, *by_fd], timeout=_POLL_S)
            for fd in ready:
                if fd in by_fd:
                    self._report_exit(by_fd[fd])
            self._report_states()
            if self.control in ready:
                try:
                    message = self.control.recv()
                except (EOFError, OSError):
                    raise EngineDeadError(
                        f"node 0 at {pc.master_addr} closed its connection to node "
                        f"{pc.node_rank} without ending the group (it stopped or died)",
                        "see node 0's log; start node 0 again, then this node",
                    ) from None
                if message[0] == "shutdown":
                    reason = message[1]
                    if reason:
                        raise EngineDeadError(
                            f"node 0 ended the group: {reason}", "see node 0's log for more"
                        )
                    logger.info("Node %d: node 0 ended the group", pc.node_rank)
                    return True
        logger.warning(
            "Node %d: stopping its workers on %s; node 0's engine loses ranks %s",
            pc.node_rank,
            signal.Signals(stop[0]).name,
            ranks.span(self.ranks),
        )
        return False

    def _report_states(self) -> None:
        """Tell node 0 which workers cannot run (stopped, or exited and not reaped) and which
        run again: node 0 reads a remote rank's state from these reports."""
        live = [(rank, self.processes[rank].pid) for rank in self.pidfds]
        now = {rank: state for rank, _, state in stopped_processes(live)}
        for rank, pid in live:
            if now.get(rank) != self.states.get(rank):
                self._send(("state", rank, pid, now.get(rank)))
        self.states = now

    def _send(self, message: tuple) -> None:
        try:
            self.control.send(message)
        except OSError:
            pass  # node 0 is gone: the control connection's end says so

    def _report_exit(self, rank: int) -> None:
        process = self.processes[rank]
        code = process.wait()
        os.close(self.pidfds.pop(rank))
        logger.log(
            logging.INFO if code == 0 else logging.WARNING,
            "Node %d: worker rank %d (pid %d) exited with %s",
            self.pc.node_rank,
            rank,
            process.pid,
            code,
        )
        self._send(("exited", rank, process.pid, code))

    def _stop_workers(self, grace: float) -> None:
        """Workers stop on node 0's "shutdown" (or their connection's end) within `grace`;
        past it they are terminated (and continued, should one be stopped: SIGTERM waits for
        that), then killed."""
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
                if process_state(process.pid) in ("T", "t"):
                    process.send_signal(signal.SIGCONT)
        for process in self.processes.values():
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()
        if self.control is not None:
            self.control.close()


def node_secret(pc: ParallelConfig) -> ClusterSecret:
    return ClusterSecret.load(
        pc.cluster_secret_file, pc.insecure_join, needed_by=f"--nnodes {pc.nnodes}"
    )


def connect_to_master(
    pc, hello: dict, deadline: float, secret: ClusterSecret | None = None
) -> tuple[socket.socket, dict]:
    """Connect to node 0's executor port, retrying until `deadline` (node 0 may start later);
    prove the cluster secret both ways (engine/distributed/join.py), send `hello`, return the
    socket and node 0's answer. Refusals and an unreachable master end in a RendezvousError
    naming the address and this node; a secret that node 0 does not share, in a
    ClusterSecretError."""
    port = rendezvous.executor_port(pc.master_port)
    where = f"{pc.master_addr}:{port}"
    secret = secret or node_secret(pc)
    try:
        sock, reply = join.dial(pc.master_addr, port, secret, hello, deadline, f"node 0 at {where}")
    except join.JoinTimeoutError as exc:
        raise RendezvousTimeoutError(
            f"node {pc.node_rank} could not reach node 0 at {where} within "
            f"{pc.rendezvous_timeout:g} s (last error: {exc.last})",
            f"start node 0 (llmctl serve ... --nnodes {pc.nnodes} --node-rank 0 "
            f"--master-addr {pc.master_addr} --master-port {pc.master_port}), check that "
            f"--master-addr is node 0's address and that this node reaches ports "
            f"{pc.master_port} and {port} there, or raise --rendezvous-timeout",
        ) from None
    except socket.gaierror as exc:
        raise RendezvousError(
            f"--master-addr {pc.master_addr} does not resolve on node {pc.node_rank} "
            f"(host {socket.gethostname()}): {exc.strerror}",
            "give every node --master-addr set to node 0's IP address",
        ) from None
    if not reply.get("ok"):
        sock.close()
        raise RendezvousError(str(reply.get("error")), reply.get("hint"))
    return sock, reply


def open_rank(pc, rank: int, token: str, secret: ClusterSecret) -> socket.socket:
    """The connection node 0 drives rank `rank` on (handed to its worker process)."""
    hello = {
        "llmctl": rendezvous.PROTOCOL,
        "kind": "rank",
        "node_rank": pc.node_rank,
        "rank": rank,
        "token": token,
    }
    deadline = time.monotonic() + join.HELLO_TIMEOUT_S
    sock, _ = connect_to_master(pc, hello, deadline, secret)
    return sock
