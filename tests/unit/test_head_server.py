"""The cluster's server, pure parts: the layout choice, the argv run in the head container, and
the in-container probe with no server."""

from __future__ import annotations

import pytest

from llmctl.cluster.errors import ConfigError, PlanError
from llmctl.cluster.inventory import parse_inventory
from llmctl.cluster.launch import head_server
from llmctl.cluster.launch.head_server import ServerState, launch_argv
from llmctl.cluster.plan.node_commands import Layout, choose_layout, serve_argv

INVENTORY = """
name: demo
image: llmctl:latest
nodes:
  - {host: 10.0.0.1, head: true, gpus: 2}
  - {host: 10.0.0.2, gpus: 2}
"""


class FakePlan:
    tensor_parallel_size, pipeline_parallel_size, reasons = 2, 1, ("fits one node with tp=2",)


def test_layout_given_planned_or_by_the_seeds_rule():
    inv = parse_inventory(INVENTORY)
    assert choose_layout(inv, "m", None, 2, None) == Layout(1, 2, "as given")
    planned = choose_layout(inv, "m", None, None, lambda m, i: FakePlan())
    assert (planned.tensor_parallel_size, planned.pipeline_parallel_size) == (2, 1)
    assert planned.reason == "llmctl plan: fits one node with tp=2"

    def no_memory(model, inventory):
        raise PlanError("no node declares gpu_memory_gib", "add it")

    seeds = choose_layout(inv, "m", None, None, no_memory)
    assert (seeds.tensor_parallel_size, seeds.pipeline_parallel_size) == (2, 2)
    assert "tp = GPUs per node, pp = nodes" in seeds.reason and "gpu_memory_gib" in seeds.reason
    no_gpus = parse_inventory(INVENTORY.replace("gpus: 2", "gpus: 0"))
    with pytest.raises(ConfigError, match="cannot choose a layout") as err:
        choose_layout(no_gpus, "m", None, None, no_memory)
    assert "pass -tp and -pp" in err.value.hint


def test_replicas_share_the_seeds_layout_when_the_plan_cannot_decide():
    """-dp N on 2 nodes of 2 GPUs: a replica per node (tp 2), or per GPU (tp 1); an N that
    divides neither is refused naming the flags."""
    inv = parse_inventory(INVENTORY)

    def no_memory(model, inventory):
        raise PlanError("no node declares gpu_memory_gib", "add it")

    two = choose_layout(inv, "m", None, None, no_memory, data_parallel_size=2)
    assert (two.tensor_parallel_size, two.pipeline_parallel_size) == (2, 1)
    assert "pp = nodes / 2 replicas" in two.reason
    four = choose_layout(inv, "m", None, None, no_memory, data_parallel_size=4)
    assert (four.tensor_parallel_size, four.pipeline_parallel_size) == (1, 1)
    assert "GPUs per node / 2 replicas per node" in four.reason
    with pytest.raises(ConfigError, match="among 3 data-parallel replicas") as err:
        choose_layout(inv, "m", None, None, no_memory, data_parallel_size=3)
    assert "pass -tp and -pp" in err.value.hint


def test_serve_argv_runs_on_ray_on_every_address():
    argv = serve_argv(
        "/models/smol", Layout(2, 2, ""), 8011,
        {"dtype": "float32", "enable_prefix_caching": False, "max_model_len": 512},
    )  # fmt: skip
    assert argv[:3] == ["llmctl", "serve", "/models/smol"]
    joined = " ".join(argv)
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 2" in joined
    assert "--distributed-executor-backend ray --host 0.0.0.0 --port 8011" in joined
    assert "--dtype float32" in joined and "--max-model-len 512" in joined
    assert "--no-enable-prefix-caching" in argv


def test_launch_keeps_the_argv_out_of_the_shell_script():
    argv = launch_argv("llmctl-demo", ["llmctl", "serve", "a model; rm -rf /"])
    assert argv[:4] == ["docker", "exec", "--detach", "llmctl-demo"]
    assert argv[-1] == "a model; rm -rf /"  # an argument of the script, never part of it
    assert "a model" not in argv[6]


def test_probe_and_stop_without_a_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(head_server, "PID_FILE", str(tmp_path / "server.pid"))
    assert head_server.main(["probe", "1"]) == 0
    assert capsys.readouterr().out.strip() == (
        '{"running": false, "health": null, "pid": null, "restarts": null}'
    )
    assert head_server.main(["stop"]) == 3
    assert head_server.main(["bogus"]) == 2
    assert ServerState(False, None).label == "stopped"
    assert ServerState(True, None).label == "starting"
    assert ServerState(True, 503).label == "unhealthy (503)"
    assert ServerState(True, 200).label == "healthy"
    assert ServerState(True, 200, 7, restarts=0).label == "healthy"
    assert ServerState(True, 200, 7, restarts=2).label == "healthy, 2 engine restarts"


def test_a_record_reads_whatever_llmctl_version_wrote_it():
    """Fields this version does not know are ignored, missing optional ones take their
    defaults; a missing or malformed required field makes no record (None), not a TypeError."""
    from llmctl.cluster.launch.head_server import ServerRecord

    written = {
        "model": "/m", "port": "8011", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
        "argv": ["llmctl", "serve", "/m"], "workers": [["n2", ["llmctl", "serve"]]],
        "backend": "mp", "served_by": "a later llmctl",
    }  # fmt: skip
    record = ServerRecord.from_json(written)
    assert record == ServerRecord(
        "/m", 8011, 2, 1, ("llmctl", "serve", "/m"), backend="mp",
        workers=(("n2", ("llmctl", "serve")),), api_key_file=None,
    )  # fmt: skip
    older = {k: v for k, v in written.items() if k not in ("backend", "workers")}
    assert ServerRecord.from_json(older).backend == "ray"
    assert ServerRecord.from_json({k: v for k, v in written.items() if k != "argv"}) is None
    assert ServerRecord.from_json({**written, "port": "eighty"}) is None
    assert ServerRecord.from_json({**written, "workers": [["n2"]]}) is None
    assert ServerRecord.from_json(["not", "a", "record"]) is None
