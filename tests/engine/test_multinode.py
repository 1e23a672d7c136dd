"""The mp backend across nodes without Ray (--nnodes): two "nodes" on this machine as two
separate process trees on 127.0.0.1. Node 0 is LLM(...) in this process; node 1 is `llmctl serve
--headless` in its own session. Greedy tokens equal the single-process engine's; a remote rank's
death, and each rendezvous fault, end in a typed error naming it, with no process left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import VOCAB, live_pids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import EngineDeadError, RendezvousError, RendezvousTimeoutError

LLMCTL = str(Path(sys.executable).with_name("llmctl"))
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
UNROUTABLE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never any host's address


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 25, 6)]


def master_port() -> int:
    """A port free on 127.0.0.1 whose successor (the executor's port) is free too."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def child_pids() -> set[int]:
    return live_pids(parent=os.getpid())


def node_args(port: int, **extra) -> dict:
    return dict(nnodes=2, master_addr="127.0.0.1", master_port=port, **extra)


def start_headless(model, port: int, *args: str, timeout: float = 120) -> subprocess.Popen:
    """Node 1: `llmctl serve MODEL --nnodes 2 --node-rank 1 --headless ...` in its own session."""
    return subprocess.Popen(
        [
            LLMCTL,
            "serve",
            *([str(model)] if model else []),  # optional: node 0 sends the model path
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--headless",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--rendezvous-timeout",
            str(timeout),
            *args,
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@contextlib.contextmanager
def reaped(process: subprocess.Popen):
    """Whatever the test did, nothing of the process's session is left running after it."""
    try:
        yield process
    finally:
        for pid in live_pids(session=process.pid) | {process.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def wait_gone(session: int, timeout: float = 30) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := live_pids(session=session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def single_process(tiny_models) -> list[list[int]]:
    with LLM(
        str(tiny_models.path("llama")),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.02,
        distributed_executor_backend="uni",
    ) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def test_pp2_on_two_nodes_matches_one_process_then_a_killed_remote_rank_is_named(
    tiny_models, single_process
):
    model = tiny_models.path("llama")
    port = master_port()
    before = child_pids()
    with reaped(start_headless(model, port, "-pp", "2")) as node1:
        llm = LLM(
            str(model),
            use_tqdm_on_load=False,
            dtype="float32",
            kv_cache_space_gib=0.02,
            pipeline_parallel_size=2,
            **node_args(port),
        )
        info = llm.llm_engine.executor.rank_info()
        assert [(r["rank"], r["pp_rank"]) for r in info] == [(0, 0), (1, 1)]
        remote_pid = info[1]["pid"]
        assert remote_pid in live_pids(session=node1.pid)  # rank 1 runs in node 1's tree
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == single_process

        os.kill(remote_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as err:
            llm.generate(prompts()[:1], GREEDY, use_tqdm=False)
        assert "worker rank 1" in err.value.message
        assert "on node 1" in err.value.message
        llm.shutdown()
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 1, out
        assert "node 0 ended the group: worker rank 1" in out
        assert not wait_gone(node1.pid)
    assert child_pids() <= before


def test_a_node_that_never_joins_is_named_and_nothing_is_left(tiny_models):
    port = master_port()
    before = child_pids()
    with pytest.raises(RendezvousTimeoutError) as err:
        LLM(
            str(tiny_models.path("llama")),
            use_tqdm_on_load=False,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            **node_args(port, rendezvous_timeout=1.0),
        )
    assert err.value.missing_node_ranks == (1,)
    assert err.value.missing_ranks == (2, 3)
    assert "node rank(s) [1] did not join node 0 at 127.0.0.1:" in err.value.message
    assert "node 1: ranks 2-3" in err.value.message
    assert "--node-rank R" in err.value.hint and "--headless" in err.value.hint
    assert child_pids() <= before
    with socket.socket() as s:  # the executor's port was given back
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port + 1))


@pytest.mark.parametrize("offset, what", [(0, "torch.distributed's"), (1, "the executor's")])
def test_a_master_port_in_use_is_named_with_the_fix(tiny_models, offset, what):
    port = master_port()
    before = child_pids()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + offset))
        holder.listen()
        with pytest.raises(RendezvousError) as err:
            LLM(str(tiny_models.path("llama")), pipeline_parallel_size=2, **node_args(port))
    assert f"port {port + offset} ({what}" in err.value.message
    assert "already in use on node 0" in err.value.message
    assert "--master-port" in err.value.hint
    assert child_pids() <= before


def test_a_master_addr_not_of_node_0_is_named(tiny_models):
    before = child_pids()
    with pytest.raises(RendezvousError) as err:
        LLM(
            str(tiny_models.path("llama")),
            pipeline_parallel_size=2,
            **{**node_args(master_port()), "master_addr": UNROUTABLE},
        )
    assert f"--master-addr {UNROUTABLE} is not an address of node 0" in err.value.message
    assert child_pids() <= before


def test_an_unreachable_master_is_named_by_the_headless_node(tiny_models):
    port = master_port()
    process = subprocess.Popen(
        [
            LLMCTL,
            "serve",
            str(tiny_models.path("llama")),
            "-pp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--headless",
            "--master-addr",
            UNROUTABLE,
            "--master-port",
            str(port),
            "--rendezvous-timeout",
            "2",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    with reaped(process):
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 1, out
        assert f"node 1 could not reach node 0 at {UNROUTABLE}:{port + 1} within 2 s" in out
        assert "--master-addr" in out
        assert not wait_gone(process.pid)


def test_doctor_all_reduce_across_two_nodes():
    """`llmctl doctor nccl --nnodes 2` on node 0, a headless node 1 (-pp = the world size): the
    check's ranks run on both nodes' trees and the sums are right."""
    port = master_port()
    with reaped(start_headless(None, port, "-pp", "2")) as node1:
        doctor = subprocess.run(
            [
                LLMCTL,
                "-q",
                "doctor",
                "nccl",
                "--backend",
                "gloo",
                "--world-size",
                "2",
                "--nnodes",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--timeout",
                "90",
                "--json",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        report = json.loads(doctor.stdout)["collectives"][0]
        assert report["world_size"] == 2 and report["ok"]
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, out
        assert "Node 1: node 0 ended the group" in out
        assert not wait_gone(node1.pid)


@pytest.mark.parametrize(
    "theirs, message",
    [
        (
            {"node_rank": 1, "tp": 2},
            "node 1 (host h1) was started with --nnodes 2 -tp 2 -pp 2, node 0 with --nnodes 2 "
            "-tp 1 -pp 2",
        ),
        ({"node_rank": 0}, "node rank 0 is node 0's own rank"),
    ],
)
def test_node_0_refuses_a_node_of_another_layout_or_its_own_rank(theirs, message):
    """Node 0's listener and a node's handshake over real sockets (no engine, no workers)."""
    from llmctl.engine.config.engine_config import ParallelConfig
    from llmctl.engine.distributed.rendezvous import PROTOCOL, NodeListener
    from llmctl.engine.executor.node_agent import connect_to_master

    pc = ParallelConfig(pipeline_parallel_size=2, **node_args(master_port()))
    listener = NodeListener(pc)
    try:
        hello = {"llmctl": PROTOCOL, "kind": "node", "nnodes": 2, "tp": 1, "pp": 2}
        hello.update(host="h1", pid=1, threads=1, **theirs)
        with pytest.raises(RendezvousError) as err:
            connect_to_master(pc, hello, time.monotonic() + 10)
        assert message in err.value.message
        assert listener.nodes == {}
    finally:
        listener.close()
