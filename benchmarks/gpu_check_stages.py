"""The GPU check's stages; benchmarks/gpu_check.py runs each in a child process of its own.

A stage writes its figures into a Result, which saves its JSON file at every assignment, so a stage
killed at its deadline leaves what it measured. Timings use CUDA events (triton.testing.do_bench,
median) or, for whole engine steps, the host clock around a call that ends synchronized (the step
copies its sampled tokens to the host). Inputs are random, never zeros.

`gpu_check.py --dry-run` runs every stage on the CPU at toy sizes (Triton's interpreter for the
kernels, no graphs, host timers): the figures mean nothing, but every line of the check runs, so
a lent GPU's minutes are not lost to a typo (tests/unit/test_gpu_check.py runs it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Sizes:
    """The workload: a GPU's, or the dry run's toy one on the CPU."""

    device, dtype = "cuda", "bfloat16"
    batches = (1, 8, 64, 256)
    peer_batches = (1, 64)  # transformers' runs
    prefills = (2048, 8192)
    in_len = out_len = 128
    attention_seqs, attention_context, attention_prefill = 64, 2048, 8192
    max_model_len_table = 131072  # the decode kernel's table as wide as Llama-3.1's length
    quantized_group = 128
    quantized_rows = (1, 256)  # decode, and a prefill chunk (no whole-weight expansion)
    seconds = 90.0  # this stage's time (run_stage sets it)


class DrySizes(Sizes):
    device, dtype = "cpu", "float32"
    batches = (1, 4)
    peer_batches = (1, 4)
    prefills = (32, 64)
    in_len = out_len = 8
    attention_seqs, attention_context, attention_prefill = 2, 32, 32
    max_model_len_table = 256
    quantized_group = 32
    quantized_rows = (1, 80)


SIZES: type[Sizes] = Sizes


class Result(dict):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=2, default=str))
        os.replace(tmp, self.path)


def run_stage(
    name: str, path: Path, model: str, seconds: float | None = None, dry_run: bool = False
) -> int:
    """Run stage `name` (its figures into the JSON at `path`); `seconds`: its deadline."""
    global SIZES
    SIZES = DrySizes if dry_run else Sizes
    SIZES.seconds = seconds or 90.0
    result = Result(path)
    try:
        STAGES[name](result, model)
    except Exception:  # noqa: BLE001 - recorded for the report; the next stage runs
        result["error"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
        return 1
    return 0


def _shape(model: str):
    from llmctl.engine.config.model_catalog import find_in_catalog
    from llmctl.engine.config.model_shape import ModelShape

    entry = find_in_catalog(model)
    if entry is not None:
        return entry.shape, entry.config_json()
    config = json.loads((Path(model) / "config.json").read_text())
    return ModelShape.from_hf_config(config), config


def _bench_us(fn) -> float:
    """Median microseconds of fn(): CUDA events on the GPU, the host clock in the dry run."""
    if SIZES.device == "cpu":
        fn()
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            runs.append(1e6 * (time.perf_counter() - start))
        return statistics.median(runs)
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def _graphed(step):
    """A CUDA graph's replay of step() (after a warm-up call); step itself in the dry run."""
    import torch

    step()
    if SIZES.device == "cpu":
        return step
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


# -- env, bandwidth, tests -------------------------------------------------------------------------


def _sync() -> None:
    import torch

    if SIZES.device == "cuda":
        torch.cuda.synchronize()


def _torch_dtype():
    from llmctl.engine.platform import torch_dtype

    return torch_dtype(SIZES.dtype)


def env(result: Result, model: str) -> None:
    import torch
    import transformers
    import triton

    from llmctl.engine.benchmarks.device_limit import cpu_name, spec_limit

    if SIZES.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        name = p.name
        result["gpu"] = {
            "name": name,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "sms": p.multi_processor_count,
            "capability": f"{p.major}.{p.minor}",
        }
    else:
        name = cpu_name()
        result["gpu"] = None
    result["versions"] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    known = spec_limit(name, "bfloat16")
    result["spec_limit"] = known.as_dict() if known else None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
             "--format=csv"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        result["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        result["nvidia_smi"] = f"not run: {exc}"


def bandwidth(result: Result, model: str) -> None:
    from llmctl.engine.benchmarks.device_limit import (
        measure_copy_bandwidth,
        measure_matmul_flops,
        measure_stream_bandwidth,
    )

    if SIZES.device == "cuda":
        result["copy_bandwidth_bytes_per_s"] = measure_copy_bandwidth("cuda")
        result["bf16_matmul_flops_per_s"] = measure_matmul_flops("cuda", "bfloat16", 8192)
    else:
        result["copy_bandwidth_bytes_per_s"] = measure_stream_bandwidth(16 << 20, 2)
        result["matmul_flops_per_s"] = measure_matmul_flops("cpu", SIZES.dtype, 256, 2)


def cuda_tests(result: Result, model: str) -> None:
    """The cuda tier, bounded by what is left of this stage's time (the parent's deadline)."""
    import xml.etree.ElementTree as ElementTree

    junit = result.path.with_name("cuda_tests.xml")
    seconds = SIZES.seconds - 5
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    argv += ["tests/cuda", f"--junitxml={junit}"]
    result["argv"] = argv
    try:
        run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
        result["exit_code"] = run.returncode
        result["tail"] = (run.stdout + run.stderr)[-3000:]
        print(run.stdout + run.stderr)  # the whole of it into gpu_check.log
    except subprocess.TimeoutExpired as exc:
        result["exit_code"] = None
        result["tail"] = f"timed out after {seconds:.0f} s: {(exc.stdout or b'')[-2000:]!r}"
        print(exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or "")
    if junit.is_file():
        suite = ElementTree.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        kinds = ("tests", "failures", "errors", "skipped")
        result["counts"] = {k: int(suite.get(k, 0)) for k in kinds}
        result["failed"] = [
            case.get("name")
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    if result.get("exit_code") not in (0, 5):
        raise RuntimeError(f"pytest -m cuda exited {result.get('exit_code')}")


# -- the floor: a decode step's matmuls alone ------------------------------------------------------


def floor(result: Result, model: str) -> None:
    """A CUDA graph of one decode step's matmuls (QKV, O, gate/up, down per layer, then the LM
    head) with cuBLAS on random weights of the model's shape and dtype: the step time no engine
    beats at this batch (norms, rotary, attention and sampling left out)."""
    import torch
    import torch.nn.functional as F

    shape, _ = _shape(model)
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    inter, dtype, dev = shape.intermediate_size, _torch_dtype(), SIZES.device

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols, dtype=dtype, device=dev).uniform_(-0.02, 0.02)

    layers = [
        (weight(q + 2 * kv, h), weight(h, q), weight(2 * inter, h), weight(h, inter))
        for _ in range(shape.num_layers)
    ]
    lm_head = weight(shape.vocab_size, h)
    count = sum(w.numel() for layer in layers for w in layer) + lm_head.numel()
    weight_bytes = count * lm_head.element_size()
    result["weight_bytes"] = weight_bytes
    rows = {}
    for batch in SIZES.batches:
        x = torch.randn(batch, h, dtype=dtype, device=dev)

        def step(x=x):
            hidden = x
            for w_qkv, w_o, w_gu, w_down in layers:
                attn = F.linear(F.linear(hidden, w_qkv)[:, :q], w_o)
                hidden = F.linear(F.linear(attn, w_gu)[:, :inter], w_down)
            return F.linear(hidden, lm_head)

        us = _bench_us(_graphed(step))
        rows[str(batch)] = {
            "ms_per_step": us / 1e3,
            "weight_bandwidth_bytes_per_s": weight_bytes / (us / 1e6),
        }
        result["decode"] = rows


# -- the engine ------------------------------------------------------------------------------------


def engine(result: Result, model: str) -> None:
    from llmctl.engine.benchmarks.device_limit import device_limit
    from llmctl.engine.benchmarks.roofline import ModelCost
    from llmctl.engine.config.engine_args import EngineArgs
    from llmctl.engine.core.llm_engine import LLMEngine

    began = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            load_format="dummy",
            dtype=SIZES.dtype,
            device=SIZES.device,
            max_model_len=max(SIZES.prefills) + 64,
            max_num_seqs=max(SIZES.batches),
            max_num_batched_tokens=max(SIZES.prefills),
            gpu_memory_utilization=0.85,
        )
    )
    result["start_to_ready_s"] = time.perf_counter() - began
    runner = engine.executor.worker.model_runner
    result["cuda_graphs"] = runner.cuda_graphs is not None
    result["attention_backend"] = runner.attn_backend.name
    cost = ModelCost.from_config(engine.config, engine.executor.rank_info())
    limit = device_limit(SIZES.device, SIZES.dtype)
    result["device_limit"] = limit.as_dict()
    vocab = engine.config.model_config.shape.vocab_size
    _generate(engine, _prompts(2, 16, vocab, 99), 4)  # warm-up: kernels compiled
    decode = {}
    for batch in SIZES.batches:
        decode[str(batch)] = _decode_run(engine, batch, vocab, cost, limit)
        result["decode"] = decode
    prefill = {}
    _generate(engine, _prompts(1, min(SIZES.prefills), vocab, 98), 1)
    for tokens in SIZES.prefills:
        runs = [_timed_generate(engine, _prompts(1, tokens, vocab, 7 + i), 1) for i in range(2)]
        seconds = min(runs)
        flops = cost.prefill_flops([tokens])
        prefill[str(tokens)] = {
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "tflops": flops / seconds / 1e12,
            "fraction_of_peak": flops / seconds / limit.peak_flops,
        }
        result["prefill"] = prefill
    engine.shutdown()


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    from llmctl.engine.benchmarks.datasets import random_requests

    return [r.prompt_token_ids for r in random_requests(count, length, 1, vocab, seed)]


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Run the prompts to completion; the wall time of each step whose requests were all
    decoding (every request already had its first token)."""
    from llmctl.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    produced = dict.fromkeys(ids, 0)
    decode_steps = []
    while engine.has_unfinished_requests():
        all_decoding = all(n > 0 for n in produced.values())
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        for output in outputs:
            produced[output.request_id] = len(output.outputs[0].token_ids)
        if all_decoding and not any(o.finished for o in outputs):
            decode_steps.append(seconds)
    return decode_steps


def _timed_generate(engine, prompts: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    _generate(engine, prompts, max_tokens)
    return time.perf_counter() - start


def _decode_run(engine, batch: int, vocab: int, cost, limit) -> dict:
    """Batch prompts of in_len -> out_len tokens: the decode steps' times, then a profiled
    window of steps: kernels per step, the GPU's busy time and the host's gap."""
    n_in, n_out = SIZES.in_len, SIZES.out_len
    start = time.perf_counter()
    steps = _generate(engine, _prompts(batch, n_in, vocab, batch), n_out)
    e2e = time.perf_counter() - start
    ms = 1000 * statistics.median(steps)
    step_bytes = cost.decode_step_bytes([n_in + n_out // 2] * batch)
    row = {
        "ms_per_step": ms,
        "tokens_per_s": batch / (ms / 1000),
        "e2e_s": e2e,
        "e2e_tokens_per_s": batch * n_out / e2e,
        "bytes_per_step": step_bytes,
        "fraction_of_bandwidth": step_bytes / (ms / 1000) / limit.bandwidth,
    }
    row.update(_profile_decode(engine, _prompts(batch, n_in, vocab, batch + 1000)))
    return row


def _profile_decode(engine, prompts: list[list[int]], window: int = 8) -> dict:
    """Kernels, device busy time and host gap per decode step over `window` steps."""
    from torch.profiler import ProfilerActivity, profile

    from llmctl.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=window + 8, ignore_eos=True)
    for p in prompts:
        engine.add_request(None, p, params)
    for _ in range(4):  # the prefill and the first decodes, unprofiled
        engine.step()
    _sync()
    activities = [ProfilerActivity.CPU]
    if SIZES.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(window):
            engine.step()
        wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    gpu_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1000 / window
    return {
        "kernels_per_step": len(kernels) / window,
        "gpu_ms_per_step": gpu_ms,
        "profiled_ms_per_step": 1000 * wall / window,
        "host_gap_ms_per_step": 1000 * wall / window - gpu_ms,
    }


# -- the kernels alone -----------------------------------------------------------------------------


def attention(result: Result, model: str) -> None:
    """The Triton attention kernels alone: paged decode of `attention_seqs` sequences of
    `attention_context` tokens (block tables as wide as the context, then as wide as a 131,072
    max_model_len), and causal prefill of one `attention_prefill`-token prompt, against torch's
    SDPA (FlashAttention on the GPU) on the same contiguous tensors."""
    import torch
    import torch.nn.functional as F

    from llmctl.engine.kernels.triton import triton_ops

    shape, _ = _shape(model)
    heads, kv_heads, d = shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    dtype, dev, block = _torch_dtype(), SIZES.device, 16
    seqs, context = SIZES.attention_seqs, SIZES.attention_context
    blocks = seqs * context // block
    cache = torch.empty(2, blocks + 1, block, kv_heads, d, dtype=dtype, device=dev).uniform_(-1, 1)
    key_cache, value_cache = cache.unbind(0)
    tables = torch.randperm(blocks, device=dev).to(torch.int32).view(seqs, context // block)
    lens = torch.full((seqs,), context, dtype=torch.int32, device=dev)
    q = torch.randn(seqs, heads, d, dtype=dtype, device=dev)
    kv_bytes = 2 * seqs * context * kv_heads * d * cache.element_size()
    rows = {}
    for width in (context // block, SIZES.max_model_len_table // block):
        padded = torch.zeros(seqs, width, dtype=torch.int32, device=dev)
        padded[:, : tables.shape[1]] = tables
        us = _bench_us(
            lambda t=padded: triton_ops.paged_decode_attention(
                q, key_cache, value_cache, t, lens, d**-0.5, None
            )
        )
        rows[f"table_width_{width}"] = {"us": us, "bandwidth_bytes_per_s": kv_bytes / (us / 1e6)}
        result[f"decode_{seqs}x{context}"] = rows
    n = SIZES.attention_prefill
    q = torch.randn(n, heads, d, dtype=dtype, device=dev)
    k = torch.randn(n, kv_heads, d, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    cache = torch.empty(2, n // block, block, kv_heads, d, dtype=dtype, device=dev)
    key_cache, value_cache = cache.unbind(0)
    triton_ops.reshape_and_cache(k, v, key_cache, value_cache, torch.arange(n, device=dev))
    table = torch.arange(n // block, device=dev, dtype=torch.int32)[None]
    loc = torch.tensor([0, n], device=dev, dtype=torch.int32)
    seq = torch.tensor([n], device=dev, dtype=torch.int32)
    ctx = torch.zeros(1, device=dev, dtype=torch.int32)
    flops = 4 * d * heads * n * (n + 1) // 2
    us = _bench_us(
        lambda: triton_ops.prefill_attention(
            q, key_cache, value_cache, table, loc, seq, ctx, n, d**-0.5, None
        )
    )
    out = {"ours_us": us, "ours_tflops": flops / (us / 1e6) / 1e12}
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    sdpa = _bench_us(
        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    )
    out |= {"torch_sdpa_us": sdpa, "torch_sdpa_tflops": flops / (sdpa / 1e6) / 1e12}
    result[f"prefill_causal_{n}"] = out


def transformers_peer(result: Result, model: str) -> None:
    """transformers' generate on the same device, shape and dtype (random weights), greedy,
    in_len -> out_len tokens, at batch 1 and 64: the peer of the engine stage's e2e figures."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _, config_json = _shape(model)
    config = AutoConfig.for_model(**config_json)
    began = time.perf_counter()
    with torch.device(SIZES.device):
        try:
            hf = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype())
        except TypeError:  # transformers < 4.56 names it torch_dtype
            hf = AutoModelForCausalLM.from_config(config, torch_dtype=_torch_dtype())
    hf.eval()
    result["load_s"] = time.perf_counter() - began
    rows = {}
    n_in, n_out = SIZES.in_len, SIZES.out_len
    for batch in SIZES.peer_batches:
        ids = torch.randint(100, config.vocab_size, (batch, n_in), device=SIZES.device)
        mask = torch.ones_like(ids)

        def generate(n: int, ids=ids, mask=mask):
            with torch.inference_mode():
                return hf.generate(
                    ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip

        generate(4)
        _sync()
        start = time.perf_counter()
        generate(n_out)
        _sync()
        seconds = time.perf_counter() - start
        rows[str(batch)] = {"e2e_s": seconds, "e2e_tokens_per_s": batch * n_out / seconds}
        result["generate"] = rows


def quantized_mm(result: Result, model: str) -> None:
    """The int4 group-quantized matmul (the engine's GPU op) at M=1 (and a 256-row prefill
    chunk) against a dense matmul on the same weights, dequantized (cuBLAS on the GPU), on the
    model's layer shapes."""
    import torch
    import torch.nn.functional as F

    from llmctl.engine.kernels.cpu.quantized_matmul import pack_groups
    from llmctl.engine.kernels.triton import triton_ops

    shape, _ = _shape(model)
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    inter = shape.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    group, rows, dev = SIZES.quantized_group, {}, SIZES.device
    for n, k in shapes:
        scales = (torch.rand(n, k // group) * 0.01 + 0.001).half()
        q4 = pack_groups(
            torch.randint(0, 16, (n, k), dtype=torch.uint8), scales, -8 * scales, 4, group
        )
        dense = q4.dequantize().to(dev, _torch_dtype())
        q4 = q4.to(dev)
        for m in SIZES.quantized_rows:
            x = torch.randn(m, k, dtype=_torch_dtype(), device=dev)

            def ours(x=x, w=q4):
                return triton_ops.group_quantized_mm(x, w.qweight, w.scales, w.zeros, 4, group)

            error = (ours().float() - F.linear(x, dense).float()).abs().max().item()
            ours_us, dense_us = _bench_us(ours), _bench_us(lambda x=x, w=dense: F.linear(x, w))
            rows.setdefault(f"m{m}", {})[f"{n}x{k}"] = {
                "int4_us": ours_us,
                "dense_us": dense_us,
                "speedup": dense_us / ours_us,
                "int4_bytes_per_s": q4.nbytes / (ours_us / 1e6),
                "max_abs_error": error,
            }
            result["rows"] = rows


STAGES = {
    "env": env,
    "bandwidth": bandwidth,
    "cuda_tests": cuda_tests,
    "floor": floor,
    "engine": engine,
    "attention": attention,
    "transformers": transformers_peer,
    "quantized_mm": quantized_mm,
}
