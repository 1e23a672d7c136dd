"""An attacker who knows llmctl's join protocols but not the cluster secret, against real nodes on
127.0.0.1: it sends node 0 the hello copied from engine/distributed/rendezvous.py, then pickled
frames whose loading would create a file; it poses as node 0 to an agent (`llmctl serve
--headless`); it does the same to a data-parallel head. Nothing is unpickled anywhere (the file
never appears), each refusal is logged with the attacker's address, the agent that met the fake
node 0 exits 1 naming the secret, and the real nodes then join and the group answers as one
process does."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
from test_multinode import (
    GREEDY,
    master_port,
    node_args,
    prompts,
    reaped,
    start_headless,
    wait_gone,
)

from llmctl.engine import LLM
from llmctl.engine.distributed import join

NODE_HELLO = {  # as rendezvous.py's docstring spells it
    "llmctl": 1, "kind": "node", "node_rank": 1, "nnodes": 2, "tp": 1, "pp": 2,
    "host": "attacker", "pid": 666, "threads": 1,
}  # fmt: skip
ATTACKER_SECRET = b"the-attacker-guessed-this-secret"


@pytest.fixture(scope="module")
def single_process(tiny_models) -> list[list[int]]:
    """The greedy tokens of prompts() from one process (the uni backend)."""
    with LLM(str(tiny_models.path("llama")), use_tqdm_on_load=False, dtype="float32",
             kv_cache_space_gib=0.02, distributed_executor_backend="uni") as llm:  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


class Payload:
    """Unpickling it creates `path`: proof that a peer's frame was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def frame(obj) -> bytes:
    """One multiprocessing Connection frame: 4-byte length, then the pickle."""
    data = pickle.dumps(obj)
    return struct.pack("!i", len(data)) + data


def connect(port: int, timeout: float = 120) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            assert time.monotonic() < deadline, f"nothing listened on port {port}"
            time.sleep(0.1)


def drain(sock: socket.socket) -> bytes:
    """Everything the listener sends until it closes the connection."""
    received = b""
    sock.settimeout(30)
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def send_all(sock: socket.socket, data: bytes) -> None:
    """The attacker sends it all, whether or not the listener still reads (it may have closed)."""
    with contextlib.suppress(OSError):
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)


def attack(port: int, hello: dict, frames: list, marker: Path) -> list[bytes]:
    """Two tries at a join listener: the copied hello and frames without any handshake; then the
    handshake done right but with a guessed secret, and the same hello and frames after it.
    Returns what the listener sent on each (it closes both)."""
    payload = [frame(f) for f in frames] + [frame(Payload(marker))]
    data = json.dumps(hello).encode() + b"\n" + b"".join(payload)
    with connect(port) as sock:
        send_all(sock, data)
        copied = drain(sock)
    with connect(port) as sock:
        greeting = join.recv_exact(sock, 45)
        nonce_p = secrets.token_bytes(32)
        proof = join._proof(ATTACKER_SECRET, join._PEER, greeting[-32:], nonce_p)
        send_all(sock, b"S" + nonce_p + proof + data)
        guessed = greeting + drain(sock)
    return [copied, guessed]


def refused_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Refused a connection from" in r.getMessage()]


def fake_node_0(server: socket.socket, marker: Path, seen: list[str]) -> None:
    """Node 0 as the attacker plays it: it answers the hello it expects with a token and a job
    whose loading would create `marker`, first as the old protocol did (no handshake), then
    with the handshake, forging the proof it cannot make."""
    job = frame(("job", Payload(marker), 1, "tcp://127.0.0.1:1", 1))
    server.settimeout(60)
    try:
        with server.accept()[0] as conn:
            conn.sendall(b'{"ok": true, "token": "t"}\n' + job)
            seen.append("copied")
        with server.accept()[0] as conn:
            conn.sendall(join.MAGIC + bytes([join.VERSION]) + b"S" + secrets.token_bytes(32))
            join.recv_exact(conn, 65)
            conn.sendall(b"+" + secrets.token_bytes(32) + b'{"ok": true, "token": "t"}\n' + job)
            seen.append("forged")
            conn.settimeout(10)
            try:
                if conn.recv(1):  # the agent's hello, or its close (a reset: it read not all)
                    seen.append("the agent sent its hello")
            except ConnectionResetError:
                pass
    except OSError as exc:
        seen.append(f"fake node 0 failed: {exc}")


def test_an_attacker_without_the_secret_runs_nothing_on_an_agent_or_on_node_0(
    tiny_models, single_process, tmp_path, caplog
):
    marker = tmp_path / "unpickled"
    model = tiny_models.path("llama")

    # An agent meets a fake node 0: it exits 1 naming the secret; nothing was unpickled.
    port = master_port()
    server = socket.create_server(("127.0.0.1", port + 1))
    seen: list[str] = []
    fake = threading.Thread(target=fake_node_0, args=(server, marker, seen), daemon=True)
    fake.start()
    with reaped(start_headless(model, port, "-pp", "2")) as node1:
        out, _ = node1.communicate(timeout=120)
        fake.join(30)
        server.close()
        assert seen == ["copied", "forged"]
        assert node1.returncode == 1, out
        assert "node 0 at 127.0.0.1:" in out
        assert "could not prove that it holds the cluster secret" in out
        assert not wait_gone(node1.pid)
    assert not marker.exists()

    # Node 0 meets the attacker while the real node joins: the group answers correctly.
    port = master_port()
    answers: list[bytes] = []
    attacker = threading.Thread(
        target=lambda: answers.extend(attack(port + 1, NODE_HELLO, [("exited", 1, 1, 0)], marker)),
        daemon=True,
    )
    with caplog.at_level(logging.WARNING, "llmctl"):
        attacker.start()
        with reaped(start_headless(model, port, "-pp", "2")) as node1:
            with LLM(str(model), use_tqdm_on_load=False, dtype="float32",
                     kv_cache_space_gib=0.02, pipeline_parallel_size=2,
                     **node_args(port)) as llm:  # fmt: skip
                attacker.join(60)
                outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outputs] == single_process
                assert len(llm.llm_engine.executor.listeners[0].nodes) == 1  # the real one
            node1.communicate(timeout=60)
    assert len(answers) == 2
    for answer in answers:  # the greeting, a refusal verdict, and nothing else
        assert answer[:11] == join.MAGIC and len(answer) == 45 + 33 and answer[45:46] != b"+"
    lines = refused_lines(caplog)
    assert any("127.0.0.1:" in line and "no cluster secret" in line for line in lines)
    assert any("its proof of the cluster secret is wrong" in line for line in lines)
    assert not marker.exists()


def test_an_attacker_without_the_secret_runs_nothing_on_the_data_parallel_head(
    tiny_models, single_process, tmp_path, caplog
):
    import asyncio

    from llmctl.engine.client.async_llm import AsyncLLM
    from llmctl.engine.config.engine_args import EngineArgs
    from llmctl.engine.distributed.ports import free_port
    from llmctl.engine.dp.join_server import DPJoinServer, replica_hello
    from llmctl.engine.dp.replica_server import ReplicaServer, join_head

    marker = tmp_path / "unpickled"
    model = str(tiny_models.path("llama"))
    args = EngineArgs(
        model=model, dtype="float32", data_parallel_size=2, data_parallel_size_local=1,
        data_parallel_address="127.0.0.1", data_parallel_rpc_port=free_port(),
    )  # fmt: skip
    placement, config = args.data_parallel_placement(), args.create_engine_config()
    head = DPJoinServer(placement, config, timeout=60)
    engine = None
    try:
        hello = replica_hello(placement, config, 1) | {"host": "attacker"}
        frames = [("ready", {}), ("output", "r0", None)]
        with caplog.at_level(logging.WARNING, "llmctl"):
            answers = attack(placement.port, hello, frames, marker)
        assert head.joined == {}
        for answer in answers:
            assert answer[:11] == join.MAGIC and len(answer) == 45 + 33
        assert len(refused_lines(caplog)) == 2
        assert not marker.exists()

        # the real node joins with its replica, and it answers as one process does
        engine = AsyncLLM.from_engine_args(
            EngineArgs(
                model=model,
                dtype="float32",
                kv_cache_space_gib=0.02,
                distributed_executor_backend="uni",
            )  # fmt: skip
        )
        conn = join_head(placement, replica_hello(placement, config, 1), timeout=30)
        server = ReplicaServer(1, engine, conn, placement)
        node = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
        node.start()
        (replica,) = head.wait_for_replicas()

        async def run() -> list[int]:
            outputs = [o async for o in replica.generate(prompts()[0], GREEDY, "r0")]
            return outputs[-1].outputs[0].token_ids

        assert asyncio.run(run()) == single_process[0]
        replica.shutdown(timeout=30)
        node.join(30)
        assert not node.is_alive()
    finally:
        head.close(reason="the test ended")
        if engine is not None:
            engine.shutdown()
    assert not marker.exists()


def test_a_node_with_another_secret_exits_1_naming_it_and_node_0_names_it_too(tmp_path):
    """Node 0's listener (no engine) and a real `llmctl serve --headless` holding another
    secret: the node exits 1 with an error naming the secret, node 0 logs and names its
    address when the nodes it waits for never joined."""
    import os
    import subprocess

    from test_multinode import LLMCTL

    from llmctl.engine.config.engine_config import ParallelConfig
    from llmctl.engine.distributed.rendezvous import NodeListener
    from llmctl.engine.errors import RendezvousTimeoutError

    port = master_port()
    pc = ParallelConfig(pipeline_parallel_size=2, rendezvous_timeout=1.0, **node_args(port))
    listener = NodeListener(pc)
    try:
        env = {**os.environ, "LLMCTL_CLUSTER_SECRET": "another-secret-of-another-cluster"}
        node1 = subprocess.run(
            [LLMCTL, "serve", "-pp", "2", "--nnodes", "2", "--node-rank", "1", "--headless",
             "--master-addr", "127.0.0.1", "--master-port", str(port)],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        out = node1.stdout + node1.stderr
        assert node1.returncode == 1, out
        assert f"node 0 at 127.0.0.1:{port + 1} refused this node's cluster secret " \
            "(LLMCTL_CLUSTER_SECRET): the nodes hold different secrets" in out  # fmt: skip
        assert listener.nodes == {}
        with pytest.raises(RendezvousTimeoutError) as err:
            listener.wait_for_nodes()
        assert "connections refused: 127.0.0.1: its proof of the cluster secret is wrong" in (
            err.value.message
        )
    finally:
        listener.close()
