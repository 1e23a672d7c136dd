"""The head's DPJoinServer against real joins on 127.0.0.1 (engine/dp_replica_server.join_head,
what a --headless node calls): each way a replica is refused names it and what to change, a
replica that never joins is named after --rendezvous-timeout, as is one that joined but whose
engine is never built, and a node that fails or leaves before its engine is built fails the head's
start by name. While the head serves, a lost remote replica's rank is taken again by its node
started again, handed over once its engine is built (or dropped, named, when it never is). No
model loads, but for one test: a real replica server on the tiny model, reporting to the head."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.distributed import join as join_protocol
from llmctl.engine.distributed.ports import free_port
from llmctl.engine.dp.join_server import PROTOCOL, DPJoinServer, replica_hello
from llmctl.engine.dp.replica_server import join_head
from llmctl.engine.errors import (
    ConfigError,
    DataParallelJoinError,
    DataParallelJoinTimeoutError,
)


@pytest.fixture
def head(tiny_models, request):
    """A head of -dp 3 --data-parallel-size-local 1 (it runs replica 0; 1 and 2 are remote),
    with --rendezvous-timeout 0.5 s, or the test's indirect parameter: a test that waits for no
    timeout gives a long one, so that a busy machine cannot run into it."""
    args = EngineArgs(
        model=str(tiny_models.path("llama")),
        served_model_name="tiny",
        data_parallel_size=3,
        data_parallel_size_local=1,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=free_port(),
    )
    placement = args.data_parallel_placement()
    config = args.create_engine_config()
    coordinator = DPJoinServer(placement, config, timeout=getattr(request, "param", 0.5))
    yield placement, config, coordinator
    coordinator.close(reason="the test ended")


def join(head, rank: int, **changes):
    placement, config, _ = head
    hello = replica_hello(placement, config, rank) | changes
    return join_head(placement, hello, timeout=5)


@pytest.mark.parametrize(
    "rank, changes, message, hint",
    [
        (1, {"dp_size": 2}, "was started with --data-parallel-size 2, the head with 3",
         "give every node the same --data-parallel-size"),
        (1, {"tp": 2}, "was started with -tp 2 -pp 1, the head with -tp 1 -pp 1",
         "the same -tp and -pp"),
        (1, {"model": "other"}, "serves model 'other', the head 'tiny'", "the same MODEL"),
        (0, {}, "data-parallel replica rank 0 was given twice: the head runs replicas 0 to 0 "
         "itself", "--data-parallel-start-rank 1 on the first"),
        (3, {}, "data-parallel replica 3 (host", "must add up to --data-parallel-size"),
        (1, {"llmctl": PROTOCOL + 1}, "is no llmctl data-parallel replica of this version",
         "the same llmctl version"),
    ],
)  # fmt: skip
def test_a_replica_that_does_not_fit_is_refused_by_name(head, rank, changes, message, hint):
    with pytest.raises(DataParallelJoinError) as err:
        join(head, rank, **changes)
    assert message in err.value.message
    assert hint in err.value.hint
    assert not head[2].joined


def test_a_rank_given_twice_names_the_node_that_holds_it(head):
    first = join(head, 1)
    with pytest.raises(DataParallelJoinError) as err:
        join(head, 1, pid=4242)
    assert "data-parallel replica rank 1 was given twice: it already joined from host" in (
        err.value.message
    )
    assert f"(pid {head[2].joined[1].pid})" in err.value.message
    assert "(pid 4242) is refused" in err.value.message
    assert "its own --data-parallel-start-rank" in err.value.hint
    first.close()


def test_replicas_that_never_join_are_named(head):
    placement, _, coordinator = head
    joined = join(head, 1)
    with pytest.raises(DataParallelJoinTimeoutError) as err:
        coordinator.wait_for_replicas()
    assert err.value.missing_replicas == (2,)
    assert (
        f"data-parallel replica(s) [2] of 3 did not join the head at {placement.endpoint} "
        "within 0.5 s (joined: [1]; the head runs [0])" in err.value.message
    )
    assert "--data-parallel-start-rank 2" in err.value.hint and "--headless" in err.value.hint
    # the replica that joined is told the head did not start
    message = joined.recv()
    assert message[0] == "shutdown" and "did not join" in message[1]


def test_a_node_that_fails_to_build_its_replica_fails_the_head_by_name(head):
    _, _, coordinator = head
    one, two = join(head, 1), join(head, 2)
    two.send(("failed", ConfigError("the KV cache does not fit", "lower --max-model-len")))
    one.send(("ready", {}))
    with pytest.raises(DataParallelJoinError) as err:
        coordinator.wait_for_replicas()
    assert err.value.message.startswith("data-parallel replica 2 (host ")
    assert "failed to start its engine: the KV cache does not fit" in err.value.message
    assert err.value.hint == "lower --max-model-len"
    assert one.recv()[0] == "shutdown"


def test_a_node_that_leaves_before_the_head_started_may_join_again(head):
    _, _, coordinator = head
    join(head, 1).close()  # it left (its node was restarted) before the others joined
    again = join(head, 1)  # ... and joins again: not "given twice"
    join(head, 2).close()  # replica 2's node leaves before its engine is built
    again.send(("ready", {}))
    with pytest.raises(DataParallelJoinTimeoutError) as err:
        coordinator.wait_for_replicas()  # replica 2 is awaited again, then named
    assert err.value.missing_replicas == (2,)
    assert "(joined: [1]; the head runs [0])" in err.value.message


def test_the_head_names_its_address_and_port_when_it_cannot_listen(head):
    placement, config, _ = head
    with pytest.raises(DataParallelJoinError) as err:  # the fixture's head holds the port
        DPJoinServer(placement, config, timeout=1)
    assert f"port {placement.port} (--data-parallel-rpc-port) is already in use" in (
        err.value.message
    )
    elsewhere = dataclasses.replace(placement, address="10.255.255.1")
    with pytest.raises(DataParallelJoinError) as err:
        DPJoinServer(elsewhere, config, timeout=1)
    assert "--data-parallel-address 10.255.255.1 is not an address of the head" in (
        err.value.message
    )


def test_a_foreign_peer_is_dropped_and_the_head_serves_on(head):
    placement, _, coordinator = head
    with socket.create_connection(("127.0.0.1", placement.port)) as peer:
        peer.sendall(b"GET / HTTP/1.1\r\n\r\n")  # no proof of the secret: dropped
        peer.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := peer.recv(1024):
                received += chunk
        except ConnectionResetError:
            pass
        assert received[: len(join_protocol.MAGIC)] == join_protocol.MAGIC  # the greeting alone
        assert len(received) == 45
    join(head, 1).close()
    secret = join_protocol.ClusterSecret.load()
    hello = {"llmctl": PROTOCOL, "kind": "node"}  # it holds the secret, but is no replica
    peer, reply = join_protocol.dial(
        "127.0.0.1", placement.port, secret, hello, time.monotonic() + 10, "the head"
    )
    peer.close()
    assert reply["ok"] is False
    assert coordinator._listener.is_alive()


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def test_a_joined_replica_whose_engine_is_never_built_is_named(head):
    # its node joined, then hangs while loading: the head does not wait for it forever
    placement, _, coordinator = head
    one, two = join(head, 1), join(head, 2)
    one.send(("ready", {}))
    with pytest.raises(DataParallelJoinTimeoutError) as err:
        coordinator.wait_for_replicas()
    assert err.value.missing_replicas == (2,)
    assert err.value.message.startswith("data-parallel replica 2 (host ")
    assert (
        f"joined the head at {placement.endpoint} but its engine was not built within 0.5 s "
        "(--rendezvous-timeout, counted from its join" in err.value.message
    )
    assert "raise --rendezvous-timeout on the head" in err.value.hint
    for conn in (one, two):  # both are told the head did not start
        message = conn.recv()
        assert message[0] == "shutdown" and "was not built within 0.5 s" in message[1]


@pytest.fixture
def serving(head):
    """The head serving with remote replicas 1 and 2 (their nodes' connections, scripted)."""
    _, _, coordinator = head
    nodes = {1: join(head, 1), 2: join(head, 2)}
    for conn in nodes.values():
        conn.send(("ready", {}))
    replicas = {r.rank: r for r in coordinator.wait_for_replicas()}
    yield coordinator, nodes, replicas
    for conn in nodes.values():
        conn.close()
    for replica in replicas.values():
        replica.shutdown(timeout=5)


@pytest.mark.parametrize("head", [30.0], indirect=True)
def test_a_lost_remote_replica_rejoins_when_its_node_starts_again(head, serving):
    coordinator, nodes, replicas = serving
    with pytest.raises(DataParallelJoinError) as err:  # replica 1 serves: its rank is taken
        join(head, 1, pid=4242)
    assert "data-parallel replica rank 1 was given twice" in err.value.message
    assert "joins once the head reports that replica dead" in err.value.hint

    nodes[1].close()  # replica 1's node dies
    wait_until(lambda: replicas[1].dead_error is not None, 10, "replica 1 seen lost")
    nodes[1] = join(head, 1, pid=4243)  # started again with the same start rank: accepted
    assert coordinator.take_rejoined() == {}  # not before its engine is built
    with pytest.raises(DataParallelJoinError) as err:  # one node at a time takes the rank
        join(head, 1, pid=4244)
    assert "(pid 4243); host" in err.value.message and "(pid 4244) is refused" in err.value.message
    nodes[1].send(("ready", {"restarts": 0}))
    rejoined = wait_until(coordinator.take_rejoined, 10, "replica 1 rejoined")
    assert list(rejoined) == [1]
    new = rejoined[1]
    assert new is not replicas[1] and new.pid == 4243 and new.health_error() is None
    replicas[1] = new
    assert coordinator.take_rejoined() == {}  # handed over once
    with pytest.raises(DataParallelJoinError):  # serving again: its rank is taken again
        join(head, 1, pid=4245)


def test_a_rejoining_node_whose_engine_is_never_built_is_dropped(head, serving):
    coordinator, nodes, replicas = serving
    nodes[2].close()
    wait_until(lambda: replicas[2].dead_error is not None, 10, "replica 2 seen lost")
    nodes[2] = join(head, 2, pid=4246)  # joins again, then hangs while loading
    assert nodes[2].poll(10)  # dropped after --rendezvous-timeout (0.5 s) from its join
    message = nodes[2].recv()
    assert message[0] == "shutdown"
    assert "the head dropped it: data-parallel replica 2 (host " in message[1]
    assert "pid 4246) joined the head" in message[1]
    assert "was not built within 0.5 s" in message[1]
    assert coordinator.take_rejoined() == {}
    nodes[2].close()
    nodes[2] = join(head, 2, pid=4247)  # the rank is free again


@pytest.mark.parametrize("head", [30.0], indirect=True)
def test_a_remote_replicas_stats_count_a_request_by_the_time_it_ends(head, tiny_models):
    """A real node-side ReplicaServer (tiny model) whose periodic reports never come: the head's
    view of its stats (what /metrics shows) counts a request once its last output arrived."""
    import asyncio
    import threading

    from llmctl.engine.client.async_llm import AsyncLLM
    from llmctl.engine.dp.replica_server import ReplicaServer
    from llmctl.engine.sampling_params import SamplingParams

    placement, _, coordinator = head
    node_args = EngineArgs(
        model=str(tiny_models.path("llama")),
        served_model_name="tiny",
        dtype="float32",
        kv_cache_space_gib=0.02,
        distributed_executor_backend="uni",
    )
    engine = AsyncLLM.from_engine_args(node_args)
    server = ReplicaServer(1, engine, join(head, 1), placement, report_interval=3600)
    node = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    node.start()
    scripted = join(head, 2)
    scripted.send(("ready", {}))
    replicas = {r.rank: r for r in coordinator.wait_for_replicas()}
    try:
        assert replicas[1].get_stats().prompt_tokens == 0  # its "ready" report

        async def run() -> list:
            params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            return [o async for o in replicas[1].generate([5, 6, 7, 8], params, "r0")]

        outputs = asyncio.run(run())
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5
        stats = replicas[1].get_stats()
        assert (stats.prompt_tokens, stats.generation_tokens) == (4, 5)
    finally:
        replicas[1].shutdown(timeout=30)
        node.join(30)
        scripted.close()
        replicas[2].shutdown(timeout=5)
    assert not node.is_alive() and not engine.is_running
