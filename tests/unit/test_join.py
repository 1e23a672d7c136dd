"""The join protocol (engine/distributed/join.py) over real sockets on 127.0.0.1: a peer joins
only by proving the cluster secret, a listener is trusted only once it proved it too, and each
way to fail (a wrong secret, a replayed handshake, a missing secret, a fake listener) is refused
by name on both sides, before the listener reads the peer's hello."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

import pytest

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.distributed import join
from llmctl.engine.distributed.join import ClusterSecret, JoinListener
from llmctl.engine.errors import ClusterSecretError, ConfigError

SECRET = ClusterSecret(b"the-cluster-secret-of-this-test", "LLMCTL_CLUSTER_SECRET")
OTHER = ClusterSecret(b"another-clusters-secret-entirely", "LLMCTL_CLUSTER_SECRET")
NONE = ClusterSecret(None, "--insecure-join")


class Listener:
    """A JoinListener on a free port that accepts every hello, recording what it was handed."""

    def __init__(self, secret: ClusterSecret) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        self.port = sock.getsockname()[1]
        self.hellos: list[dict] = []
        self.listener = JoinListener(sock, secret, self._on_hello, "test-join")

    def _on_hello(self, sock, hello, peer) -> None:
        self.hellos.append(hello)
        join.accept(sock, peer=peer)
        sock.close()

    def dial(self, secret: ClusterSecret, hello: dict | None = None) -> dict:
        sock, reply = join.dial(
            "127.0.0.1",
            self.port,
            secret,
            hello or {"kind": "test"},
            time.monotonic() + 10,
            "node 0 at the test",
        )
        sock.close()
        return reply


@pytest.fixture
def listener(request):
    listener = Listener(getattr(request, "param", SECRET))
    yield listener
    listener.listener.close()


def refusal_logged(caplog, why: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if why in r.getMessage()]


def test_a_peer_with_the_secret_joins_and_is_handed_to_the_caller(listener):
    reply = listener.dial(SECRET, {"kind": "test", "node_rank": 1})
    assert reply["ok"] is True and reply["peer"].startswith("127.0.0.1:")
    assert listener.hellos == [{"kind": "test", "node_rank": 1}]


def test_a_wrong_secret_is_refused_by_name_on_both_sides(listener, caplog):
    with caplog.at_level(logging.WARNING, "llmctl"), pytest.raises(ClusterSecretError) as err:
        listener.dial(OTHER)
    assert "node 0 at the test refused this node's cluster secret (LLMCTL_CLUSTER_SECRET): the " \
        "nodes hold different secrets" in err.value.message  # fmt: skip
    assert "the same LLMCTL_CLUSTER_SECRET or --cluster-secret-file" in err.value.hint
    logged = refusal_logged(caplog, "its proof of the cluster secret is wrong")
    assert len(logged) == 1 and logged[0].startswith("Refused a connection from 127.0.0.1:")
    assert listener.hellos == []  # its hello was never read
    assert "its proof of the cluster secret is wrong" in listener.listener.refused["127.0.0.1"]


def _answer(sock: socket.socket, secret: ClusterSecret) -> tuple[bytes, bytes]:
    """A peer's side by hand: read the greeting, send mode, nonce and proof; returns (what was
    sent, the verdict)."""
    greeting = join.recv_exact(sock, 45)
    nonce_l = greeting[-32:]
    nonce_p = secrets.token_bytes(32)
    answer = b"S" + nonce_p + join._proof(secret.key, join._PEER, nonce_l, nonce_p)
    sock.sendall(answer)
    return answer, join.recv_exact(sock, 33)


def test_a_replayed_handshake_is_refused_by_name(listener, caplog):
    with socket.create_connection(("127.0.0.1", listener.port)) as first:
        recorded, verdict = _answer(first, SECRET)
        assert verdict[:1] == b"+"  # the real exchange was accepted
    with socket.create_connection(("127.0.0.1", listener.port)) as replay:
        join.recv_exact(replay, 45)  # a fresh greeting, with a nonce of its own
        with caplog.at_level(logging.WARNING, "llmctl"):
            replay.sendall(recorded)  # the recorded answer, byte for byte
            assert join.recv_exact(replay, 33)[:1] == b"R"
            replay.sendall(b'{"kind": "test"}\n')
            assert replay.recv(1) == b""  # closed: nothing after it was read
    assert refusal_logged(caplog, "it replayed an earlier handshake")
    assert listener.hellos == []


def test_a_replay_is_refused_even_when_recorded_on_another_listener(listener):
    """A handshake recorded against one node 0 fails on another: the proof covers the nonce."""
    other = Listener(SECRET)
    try:
        with socket.create_connection(("127.0.0.1", other.port)) as first:
            recorded, _ = _answer(first, SECRET)
        with socket.create_connection(("127.0.0.1", listener.port)) as replay:
            join.recv_exact(replay, 45)
            replay.sendall(recorded)
            assert join.recv_exact(replay, 33)[:1] == b"S"
    finally:
        other.listener.close()


def test_a_peer_without_a_secret_is_refused_by_name(listener, caplog):
    with caplog.at_level(logging.WARNING, "llmctl"), pytest.raises(ClusterSecretError) as err:
        listener.dial(NONE)
    assert "node 0 at the test requires a cluster secret, and this node has none" in (
        err.value.message
    )
    assert "secrets.token_hex(32)" in err.value.hint
    assert refusal_logged(caplog, "it offers no cluster secret (--insecure-join, or no llmctl")
    assert listener.hellos == []


@pytest.mark.parametrize("listener", [NONE], indirect=True)
def test_a_node_with_a_secret_does_not_join_an_insecure_listener(listener):
    with pytest.raises(ClusterSecretError) as err:
        listener.dial(SECRET)
    assert "runs without a cluster secret (--insecure-join), and this node holds one" in (
        err.value.message
    )
    assert listener.dial(NONE)["ok"] is True  # both insecure: it joins


def test_a_fake_listener_without_the_secret_is_not_trusted():
    """It greets and accepts, but cannot prove the secret: the peer leaves before its hello,
    and reads none of what the fake sends."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    got: list[bytes] = []

    def fake() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(join.MAGIC + bytes([join.VERSION]) + b"S" + secrets.token_bytes(32))
            join.recv_exact(conn, 65)
            conn.sendall(b"+" + secrets.token_bytes(32))  # a proof it cannot make
            conn.sendall(b'{"ok": true, "token": "t"}\n')
            conn.settimeout(10)
            while chunk := conn.recv(1024):
                got.append(chunk)

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    with pytest.raises(ClusterSecretError) as err:
        join.dial("127.0.0.1", server.getsockname()[1], SECRET, {"secret": "no"},
                  time.monotonic() + 10, "node 0 at 127.0.0.1")  # fmt: skip
    thread.join(10)
    server.close()
    assert "node 0 at 127.0.0.1 could not prove that it holds the cluster secret" in (
        err.value.message
    )
    assert got == []  # the hello never left the peer


def test_an_unreachable_listener_ends_in_a_timeout_naming_the_last_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there
    with pytest.raises(join.JoinTimeoutError) as err:
        join.dial("127.0.0.1", port, SECRET, {}, time.monotonic() + 0.3, "node 0")
    assert "refused" in err.value.last.lower()


def test_the_secret_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMCTL_CLUSTER_SECRET", "  from-the-environment-0123  \n")
    assert ClusterSecret.load().key == b"from-the-environment-0123"
    path = tmp_path / "cluster.secret"
    path.write_text("from-the-file-0123456789\n")
    os.chmod(path, 0o600)
    loaded = ClusterSecret.load(str(path))
    assert loaded.key == b"from-the-file-0123456789"
    assert str(path) in loaded.source and "from-the-file" not in repr(loaded)
    with pytest.raises(TypeError):  # never sent anywhere (configs travel to workers)
        import pickle

        pickle.dumps(loaded)
    assert ClusterSecret.load(insecure=True).insecure


def test_a_missing_or_short_secret_is_refused_with_a_hint(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMCTL_CLUSTER_SECRET", raising=False)
    with pytest.raises(ConfigError) as err:
        EngineArgs(nnodes=2, master_addr="127.0.0.1", pipeline_parallel_size=2)
    assert err.value.message.startswith("--nnodes 2 joins nodes over the network, and no cluster "
                                        "secret is set (LLMCTL_CLUSTER_SECRET or "
                                        "--cluster-secret-file)")  # fmt: skip
    assert "secrets.token_hex(32)" in err.value.hint and "--insecure-join" in err.value.hint
    with pytest.raises(ConfigError) as err:
        EngineArgs(data_parallel_size=2, data_parallel_size_local=1,
                   data_parallel_address="127.0.0.1")  # fmt: skip
    assert err.value.message.startswith("data parallel across nodes (--data-parallel-address) "
                                        "joins nodes over the network")  # fmt: skip
    monkeypatch.setenv("LLMCTL_CLUSTER_SECRET", "short")
    with pytest.raises(ConfigError) as err:
        EngineArgs(nnodes=2, master_addr="127.0.0.1", pipeline_parallel_size=2)
    assert "has 5 characters; use at least 16" in err.value.message
    with pytest.raises(ConfigError) as err:
        EngineArgs(nnodes=2, master_addr="127.0.0.1", pipeline_parallel_size=2,
                   cluster_secret_file=str(tmp_path / "missing"))  # fmt: skip
    assert f"--cluster-secret-file {tmp_path / 'missing'} cannot be read" in err.value.message
    args = EngineArgs(nnodes=2, master_addr="127.0.0.1", pipeline_parallel_size=2,
                      insecure_join=True)  # fmt: skip
    assert args.create_parallel_config().insecure_join
