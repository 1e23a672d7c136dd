"""The engine options of `generate`, `serve` and `plan` are EngineArgs' fields: each shows in the
help of the commands it belongs to, reaches EngineArgs under its own name, and comes back from the
argv the cluster's head runs. Adding a field adds the option everywhere."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import llmctl.engine
from llmctl.cli import generate as generate_command
from llmctl.cli import serve as serve_command
from llmctl.cli.engine_options import engine_options
from llmctl.cluster.plan.node_commands import Layout, serve_argv
from llmctl.engine.config.engine_args import EngineArgs, cli_options, engine_args_to_argv
from llmctl.engine.config.options import option

WIDE = {"COLUMNS": "200"}


class _Recorded(Exception):
    pass


@pytest.fixture
def served(monkeypatch):
    """What `serve` hands the server: {"engine_args": EngineArgs, "server_config": ...}."""
    seen = {}

    def record(engine_args, server_config, progress=None):
        seen.update(engine_args=engine_args, server_config=server_config)
        raise _Recorded

    monkeypatch.setattr("llmctl.engine.entrypoints.openai.api_server.run_server", record)
    return seen


@pytest.fixture
def generated(monkeypatch):
    """The keywords `generate` gives LLM(...)."""
    seen = {}

    class RecordingLLM:
        def __init__(self, model, *, use_tqdm_on_load, **kwargs):
            seen.update(kwargs)
            raise _Recorded

    monkeypatch.setattr("llmctl.engine.entrypoints.llm.LLM", RecordingLLM)
    return seen


def _flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])-{1,2}[a-z][a-z0-9-]*", help_text))


def _unwrapped(help_text: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", help_text).split())


@pytest.mark.parametrize("command", ["generate", "serve", "plan"])
def test_every_option_of_the_command_is_in_its_help(invoke, command):
    result = invoke(command, "--help", env=WIDE)
    assert result.exit_code == 0
    shown = _flags(result.stdout)
    options = cli_options(command)
    assert options
    for o in options:
        for decl in o.param_decls:
            assert set(decl.split("/")) <= shown, f"{command} --help lacks {decl}"
    if command != "plan":  # plan restyles its shared options (see test_plan_shares_...)
        for o in options:
            assert o.help.split(" (default")[0] in _unwrapped(result.stdout)


def test_plan_shares_the_planner_options_and_keeps_its_own(invoke):
    text = invoke("plan", "--help", env=WIDE).stdout
    shown = _flags(text)
    assert {"--gpu-memory-utilization", "--block-size", "--kv-cache-space-gib", "-tp", "-pp"} <= (
        shown
    )
    assert {"--enforce-eager", "--served-model-name", "--tokenizer"}.isdisjoint(shown)
    assert "Evaluate this layout instead of choosing." in text  # plan's own words for -tp/-pp
    assert "[default: cuda]" in text  # plan's own default device


def test_tp_alias_reaches_the_engine(invoke, served, generated):
    with pytest.raises(_Recorded):
        invoke("-q", "serve", "m", "-tp", "2", "-pp", "3")
    args = served["engine_args"]
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    with pytest.raises(_Recorded):
        invoke("-q", "generate", "m", "-p", "a", "-tp", "2")
    assert generated["tensor_parallel_size"] == 2
    assert "pipeline_parallel_size" not in generated  # not given: the engine's default


def test_plan_takes_the_engine_options(invoke):
    result = invoke(
        "plan", "Llama-3.1-8B", "--json", "-tp", "2", "--block-size", "32",
        "--gpu-memory-utilization", "0.8", "--max-model-len", "4096",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    import json

    plan = json.loads(result.stdout)
    assert (plan["tensor_parallel_size"], plan["block_size"]) == (2, 32)
    assert plan["gpu_memory_utilization"] == 0.8
    assert "--block-size 32" in plan["commands"]["serve"]


def test_serve_on_a_cluster_forwards_the_engine_options(invoke, served, monkeypatch):
    seen = {}

    def record(inventory, model, tp, pp, port, options, *, server, stop, wait, backend, api_key):
        seen.update(tp=tp, pp=pp, port=port, options=options, server=server, backend=backend)

    monkeypatch.setattr(serve_command, "_serve_on_cluster", record)
    result = invoke(
        "-q", "serve", "m", "-i", "cluster.yaml", "-tp", "2", "--port", "8011",
        "--gpu-memory-utilization", "0.8", "--served-model-name", "smol", "--enforce-eager",
        "--no-enable-prefix-caching", "--max-model-len", "512", "--http-timeout", "60",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (seen["tp"], seen["pp"]) == (2, None)  # the layout, chosen apart
    assert seen["backend"] is None  # none asked: the one the cluster was started with
    assert seen["options"] == {
        "served_model_name": "smol",
        "dtype": "auto",
        "max_model_len": 512,
        "gpu_memory_utilization": 0.8,
        "enforce_eager": True,
        "enable_prefix_caching": False,
    }
    # The head runs `llmctl serve` with them: parsed back, they are the same EngineArgs.
    assert seen["server"] == {"http_timeout": 60.0}  # the server's options given, too
    argv = serve_argv("m", Layout(2, 1, ""), seen["port"], seen["options"], seen["server"])
    assert argv[:2] == ["llmctl", "serve"]
    with pytest.raises(_Recorded):
        invoke("-q", *argv[1:])
    args, server = served["engine_args"], served["server_config"]
    expected = EngineArgs(
        model="m", tensor_parallel_size=2, distributed_executor_backend="ray", **seen["options"]
    )
    assert args == expected
    assert (server.host, server.port, server.http_timeout) == ("0.0.0.0", 8011, 60.0)
    assert server.shutdown_timeout == 30.0  # not given: not forwarded, the default


# Adding an option is one edit: a field with its OptionSpec. vLLM's --max-logprobs, say.
WithMaxLogprobs = dataclasses.make_dataclass(
    "EngineArgs",
    [("max_logprobs", int, option("Most log-probabilities returned per token.", default=20))],
    bases=(EngineArgs,),
)


def _app(command) -> typer.Typer:
    """The command's Typer app, its engine options derived from WithMaxLogprobs."""
    app = typer.Typer()
    app.command()(engine_options(command.__name__, args_class=WithMaxLogprobs)(command.__wrapped__))
    return app


@pytest.mark.parametrize("command", [generate_command.generate, serve_command.serve])
def test_a_new_field_is_a_new_option_everywhere(command, served, generated, monkeypatch):
    app, runner = _app(command), CliRunner()
    help_text = runner.invoke(app, ["--help"], env=WIDE).stdout
    assert "--max-logprobs" in help_text
    assert "Most log-probabilities returned per token. (default: 20)" in help_text

    monkeypatch.setattr("llmctl.engine.config.engine_args.EngineArgs", WithMaxLogprobs)
    args = ["m", "--max-logprobs", "5", "-tp", "2"]
    result = runner.invoke(app, [*args, "-p", "a"] if command.__name__ == "generate" else args)
    assert isinstance(result.exception, _Recorded), result.output
    if command.__name__ == "serve":
        engine_args = served["engine_args"]
        assert isinstance(engine_args, WithMaxLogprobs)
        assert (engine_args.max_logprobs, engine_args.tensor_parallel_size) == (5, 2)
    else:
        assert (generated["max_logprobs"], generated["tensor_parallel_size"]) == (5, 2)
    argv = engine_args_to_argv({"max_logprobs": 5}, args_class=WithMaxLogprobs)
    assert argv == ["--max-logprobs", "5"]


# Flags the engine's messages name that are not llmctl's: the worker's and the kernel builds' own
# argv, `ray start`, pip, and the docstrings and f-strings of engine_args.py.
_NOT_LLMCTL = {
    "--fd", "--build", "--num-gpus", "--no-deps", "--field-name", "--x", "--no-x", "--no"
}  # fmt: skip


def test_every_flag_the_engine_names_exists(invoke):
    named = set()
    for path in Path(llmctl.engine.__file__).parent.rglob("*.py"):
        named |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", path.read_text()))
    accepted = set()
    commands = [["generate"], ["serve"], ["plan"], ["bench", "throughput"], ["bench", "latency"]]
    for args in ([], *commands, ["bench", "serve"], ["cluster", "up"]):
        accepted |= _flags(invoke(*args, "--help", env=WIDE).stdout)
    assert named - _NOT_LLMCTL <= accepted, sorted(named - _NOT_LLMCTL - accepted)
