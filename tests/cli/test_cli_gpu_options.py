"""The GPU options of `generate` and `serve` (--device, --gpu-memory-utilization, --enforce-eager):
they reach the engine under vLLM's names, and bad values or a missing GPU are one error line and
one hint, with no process left running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import live_pids

from llmctl.engine.config.engine_args import EngineArgs

LLMCTL = str(Path(sys.executable).with_name("llmctl"))
SMALL_CACHE = ("--kv-cache-space-gib", "0.01")
no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def _error_lines(stderr: str) -> tuple[str, str]:
    [error] = [line for line in stderr.splitlines() if line.startswith("error: ")]
    [hint] = [line for line in stderr.splitlines() if line.startswith("hint: ")]
    return error, hint


def _children() -> set[int]:
    return live_pids(parent=os.getpid())


NO_CUDA_ERROR = (
    f"error: device cuda was asked for, but torch sees no CUDA device (torch {torch.__version__}"
)
NO_CUDA_HINT = "hint: use --device cpu (or auto, which picks the CPU here), or run on a machine "


@no_gpu_here
def test_generate_on_cuda_without_a_gpu_names_device_cpu(invoke, tiny_llama):
    before = _children()
    result = invoke("generate", tiny_llama, "-p", "hi", "--device", "cuda", env={"COLUMNS": "80"})

    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert error.startswith(NO_CUDA_ERROR)
    assert hint.startswith(NO_CUDA_HINT)  # one line, however narrow the terminal
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert _children() <= before


@no_gpu_here
@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["serve"]])
def test_console_script_on_cuda_without_a_gpu_leaves_nothing_running(command):
    process = subprocess.Popen(
        [LLMCTL, *command, "--device", "cuda"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own session: anything it started would still be in it
    )
    stdout, stderr = process.communicate(timeout=120)

    assert process.returncode == 1, stderr
    error, hint = _error_lines(stderr)
    assert error.startswith(NO_CUDA_ERROR) and hint.startswith(NO_CUDA_HINT)
    assert "Traceback" not in stderr and stdout == ""
    assert not live_pids(session=process.pid)


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["plan"]])
@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_utilization_outside_0_1_names_the_flag(invoke, tiny_llama, command, value):
    result = invoke(command[0], tiny_llama, *command[1:], "--gpu-memory-utilization", value)

    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert error == f"error: gpu_memory_utilization must be in (0, 1], got {float(value)}"
    assert hint == (
        "hint: pass --gpu-memory-utilization a fraction of each GPU's memory, such as 0.9 "
        "(the default)"
    )


def test_more_ranks_than_gpus_on_mp_names_tp_pp_and_ray(invoke, tiny_llama, monkeypatch):
    # A node with one GPU, as torch would report it: the layout is refused before any worker
    # process starts or any weight loads.
    monkeypatch.setattr("llmctl.engine.platform.cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = _children()
    result = invoke(
        "generate", tiny_llama, "-p", "hi", "--device", "cuda", "-tp", "2", "-pp", "2",
        "--distributed-executor-backend", "mp",
    )  # fmt: skip

    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert error == (
        "error: tensor_parallel_size=2 x pipeline_parallel_size=2 needs 4 GPUs, but this node has 1"
    )
    assert hint == (
        "hint: lower -tp/-pp to use at most 1 GPU(s), or run on several nodes with "
        "--distributed-executor-backend ray (`llmctl cluster up`, then `llmctl serve -i`)"
    )
    assert _children() <= before


class _Recorded(Exception):
    pass


def test_serve_passes_the_gpu_options_to_the_engine(invoke, monkeypatch):
    seen = {}

    def record(engine_args, server_config, progress=None):
        seen["engine_args"] = engine_args
        raise _Recorded

    monkeypatch.setattr("llmctl.engine.entrypoints.openai.api_server.run_server", record)
    with pytest.raises(_Recorded):
        invoke(
            "-q", "serve", "some/model", "--device", "cuda", "--gpu-memory-utilization", "0.75",
            "--enforce-eager",
        )  # fmt: skip
    args: EngineArgs = seen["engine_args"]
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("cuda", 0.75, True)
    # Not given: the engine's defaults.
    defaults = EngineArgs()
    with pytest.raises(_Recorded):
        invoke("-q", "serve", "some/model")
    args = seen["engine_args"]
    assert (
        (args.device, args.gpu_memory_utilization, args.enforce_eager)
        == (
            defaults.device,
            defaults.gpu_memory_utilization,
            defaults.enforce_eager,
        )
        == ("auto", 0.9, False)
    )


def test_generate_passes_the_gpu_options_to_the_engine(invoke, monkeypatch):
    seen = {}

    class RecordingLLM:
        def __init__(self, model, *, use_tqdm_on_load, **kwargs):
            seen["kwargs"] = kwargs
            raise _Recorded

    monkeypatch.setattr("llmctl.engine.entrypoints.llm.LLM", RecordingLLM)
    with pytest.raises(_Recorded):
        invoke(
            "-q", "generate", "m", "-p", "a", "--device", "cpu", "--gpu-memory-utilization",
            "0.5", "--enforce-eager",
        )  # fmt: skip
    kwargs = seen["kwargs"]
    assert (kwargs["device"], kwargs["gpu_memory_utilization"], kwargs["enforce_eager"]) == (
        "cpu",
        0.5,
        True,
    )


def test_enforce_eager_reaches_the_model_config(tiny_llama):
    for enforce_eager in (False, True):
        config = EngineArgs(
            model=tiny_llama, device="cpu", enforce_eager=enforce_eager
        ).create_engine_config()
        assert config.model_config.enforce_eager is enforce_eager


def test_unknown_device_is_refused_before_loading(invoke):
    result = invoke("generate", "-p", "hi", "--device", "tpu")
    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert error == "error: unknown device 'tpu'"
    assert hint == "hint: use --device auto, cpu or cuda"
