"""The GPU check: everything a lent GPU should measure, in one call, within its own time budget.

    python benchmarks/gpu_check.py --out DIR [--budget 420] [--model Llama-3.1-8B]
    make gpu-check OUT=DIR

Needs only torch, transformers and triton beside this tree: when llmctl is not installed, the
tree is put on the import path (a folder of links named llmctl/), for this process and its
children. Each stage runs in a child process with a deadline (a stage that hangs or crashes is
killed and recorded, the next stage runs), so the whole check ends within --budget seconds
whatever happens (420 s: 7 minutes on one H100 or H200). After every stage DIR/gpu_check.json is
rewritten with everything so far; DIR/gpu_check.log holds each stage's output. Stages
(benchmarks/gpu_check_stages.py), in order:

    env             the GPU, its memory and SMs, torch / triton / transformers versions
    bandwidth       device-to-device copy bandwidth and the bf16 matmul peak, measured
    floor           a CUDA graph of one decode step's matmuls alone (cuBLAS, the model's shape,
                    batch 1, 8, 64, 256): the floor a decode step cannot beat
    engine          the engine on a dummy-weight model (bf16, CUDA graphs): start-to-ready;
                    batch 1, 8, 64, 256 with 128 in / 128 out: ms per step, tokens/s, kernels
                    per step, GPU time and host gap per step, fraction of bandwidth; prefill of
                    2k and 8k tokens: TFLOP/s and fraction of the peak
    attention       the Triton kernels alone: decode at 64 x 2k (block tables as wide as 2k and
                    as max_model_len 131072), causal prefill of 8k
    transformers    transformers' generate on the same GPU and shape, batch 1 and 64: the ratio
    quantized_mm    the int4 group-quantized matmul at M=1 (and 256) against cuBLAS bf16, 8B's
                    shapes
    cuda_tests      `pytest -m cuda tests/cuda` (all of it, output into the log), with what is left

Without a GPU it prints why, writes that to the JSON and exits with status 2. `--dry-run` runs
every stage on the CPU at toy sizes instead (the figures mean nothing; the code paths all run),
on a toy model named with --model DIR: one over 1 B parameters is refused, naming the option.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_GPU_EXIT = 2
# (stage, most seconds it may take); each also gets no more than what is left of the budget
# The measurements first; the cuda tier last, with what is left (at least its cap's worth
# when every stage before keeps to its own).
STAGES = (
    ("env", 20),
    ("bandwidth", 20),
    ("floor", 40),
    ("engine", 120),
    ("attention", 30),
    ("transformers", 50),
    ("quantized_mm", 40),  # 20 s was spent before its last shape on a fresh H200
    ("cuda_tests", 180),  # the tier took 97 s on an H200, over 105 s on a fresh one
)
_RESERVE_S = 5  # kept back to write the results and exit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the JSON and log")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check")
    parser.add_argument("--model", default="Llama-3.1-8B", help="a catalog name or config dir")
    parser.add_argument("--stages", default=",".join(s for s, _ in STAGES))
    parser.add_argument(
        "--dry-run", action="store_true", help="run every stage on the CPU at toy sizes"
    )
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # a child: run this stage alone
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)  # the child's JSON file
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)  # the child's time
    args = parser.parse_args()
    _put_tree_on_path()
    if args.stage:
        from gpu_check_stages import run_stage

        return run_stage(args.stage, args.result, args.model, args.seconds, args.dry_run)
    return run_check(args)


def run_check(args) -> int:
    start = time.monotonic()
    deadline = start + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"budget_s": args.budget, "model": args.model, "stages": {}}
    json_path, log_path = args.out / "gpu_check.json", args.out / "gpu_check.log"
    if args.dry_run:
        reason = _too_large_for_a_dry_run(args.model)
        if reason is not None:
            report["error"] = reason
            _write(json_path, report)
            print(f"gpu_check: {reason}; nothing run (JSON: {json_path})")
            return NO_GPU_EXIT
    reason = None if args.dry_run else _no_gpu_reason()
    if reason is not None:
        report["gpu"] = None
        report["error"] = f"no GPU: {reason}"
        _write(json_path, report)
        print(f"gpu_check: no GPU: {reason}; nothing measured (JSON: {json_path})")
        return NO_GPU_EXIT
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    work = Path(tempfile.mkdtemp(prefix="llmctl-gpu-check-"))
    env = _child_env(work, args.dry_run)
    with open(log_path, "w") as log:
        for stage, cap in STAGES:
            if stage not in wanted:
                continue
            left = deadline - time.monotonic() - _RESERVE_S
            if left < 5:
                report["stages"][stage] = {"status": "skipped: the budget is spent"}
                _write(json_path, report)
                continue
            report["stages"][stage] = _run_stage(stage, min(cap, left), args, work, env, log)
            report["elapsed_s"] = time.monotonic() - start
            _write(json_path, report)
            print(f"gpu_check: {stage}: {report['stages'][stage].get('status')}", flush=True)
    report["elapsed_s"] = time.monotonic() - start
    _write(json_path, report)
    print(json.dumps(_summary(report), indent=1))
    return 0


def _run_stage(stage: str, timeout: float, args, work: Path, env: dict, log) -> dict:
    """One stage in a child process, killed at `timeout`; what it wrote so far, and how it ended."""
    result = work / f"{stage}.json"
    argv = [sys.executable, "-u", __file__, "--out", str(args.out), "--model", args.model]
    argv += ["--stage", stage, "--result", str(result), "--seconds", f"{timeout:.0f}"]
    argv += ["--dry-run"] if args.dry_run else []
    log.write(f"\n===== {stage} (up to {timeout:.0f} s) =====\n")
    log.flush()
    began = time.monotonic()
    # A session of its own: at the deadline the stage and whatever it started (pytest's
    # processes, an engine's workers) are killed together, and their GPU memory goes with them.
    child = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        code = child.wait(timeout=timeout)
        status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        status = f"timed out after {timeout:.0f} s"
    data = json.loads(result.read_text()) if result.is_file() else {}
    data["status"] = data.get("status", status) if status == "ok" else status
    data["seconds"] = round(time.monotonic() - began, 1)
    return data


DRY_RUN_MAX_PARAMS = 1_000_000_000  # the dry run builds the model on the CPU, in float32


def _too_large_for_a_dry_run(model: str) -> str | None:
    """Why `model` cannot run the CPU dry run (a catalog model of billions of parameters would
    take all the memory, Llama-3.1-8B 32 GB in float32), or None."""
    from gpu_check_stages import _shape  # (main put this folder on the path)

    params = _shape(model)[0].total_params()
    if params <= DRY_RUN_MAX_PARAMS:
        return None
    return (
        f"the dry run builds {model} ({params / 1e9:.1f} B parameters) on the CPU: name a toy "
        f"config with --model DIR (a config.json of at most {DRY_RUN_MAX_PARAMS / 1e9:.0f} B)"
    )


def _no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed ({exc})"
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"torch {torch.__version__} ({build}) sees no CUDA device"


def _put_tree_on_path() -> None:
    """Import this tree as llmctl (and the stages module) without installing it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import llmctl.engine  # noqa: F401

        return
    except ImportError:
        pass
    shim = Path(tempfile.gettempdir()) / f"llmctl-tree-{os.getuid()}"
    package = shim / "llmctl"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("engine", "cli", "cluster"):
        link = package / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p
    )


def _child_env(work: Path, dry_run: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if dry_run:  # the Triton kernels on the CPU
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["LLMCTL_CACHE_DIR"] = str(work / "cache")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _summary(report: dict) -> dict:
    """The figures that answer the issue's goals, for the end of the output: per batch the
    engine's ms per decode step against the matmul-only floor, its fraction of the bandwidth,
    kernels and host gap per step, and its end-to-end speed over transformers'."""
    stages = report["stages"]
    out: dict = {name: data.get("status") for name, data in stages.items()}
    engine = stages.get("engine", {})
    floor = stages.get("floor", {}).get("decode", {})
    peer = stages.get("transformers", {}).get("generate", {})
    for batch, row in engine.get("decode", {}).items():
        line = {k: _round(row.get(k)) for k in _ENGINE_KEYS}
        if batch in floor:
            line["over_floor"] = _round(row["ms_per_step"] / floor[batch]["ms_per_step"])
        if batch in peer:
            line["x_transformers"] = _round(
                row["e2e_tokens_per_s"] / peer[batch]["e2e_tokens_per_s"]
            )
        out[f"engine batch {batch}"] = line
    for key in ("start_to_ready_s", "prefill"):
        if key in engine:
            out[f"engine {key}"] = engine[key]
    for key in ("attention", "quantized_mm"):
        data = {k: v for k, v in stages.get(key, {}).items() if k not in ("status", "seconds")}
        if data:
            out[key] = data
    return out


_ENGINE_KEYS = (
    "ms_per_step",
    "fraction_of_bandwidth",
    "kernels_per_step",
    "gpu_ms_per_step",
    "host_gap_ms_per_step",
)


def _round(value):
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    sys.exit(main())
