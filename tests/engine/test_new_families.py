"""Qwen3, Gemma 3, Phi-3 and gpt-oss token-exact against Hugging Face transformers in float32:
8 prompts x 24 tokens on tiny random models whose windows (12 tokens) the prompts pass, alone,
tensor parallel (2 ranks), pipeline parallel (2 stages) and, for gpt-oss, expert parallel; and
what sliding-window layers do to the KV cache: their blocks beyond the window go back to the
pool, so more requests run at once, exactly as before.

What each tiny config exercises (tests/support.py new_family_configs): Qwen3 its q/k norm;
Gemma 3 sliding and global layers (2 to 1) with their own ropes, query_pre_attn_scalar, (1 + w)
norms, the embedding scale, GELU-tanh; Phi-3 its fused qkv_proj and gate_up_proj split per rank,
partial rotary and LongRoPE (prompts of 40 start past its 32 tokens, shorter ones cross them while
they generate and are computed again); gpt-oss sinks, sliding and full layers alternating, biased
experts with the clamped SwiGLU, YaRN. The Triton path: tests/kernels/test_engine_on_triton.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from support import NEW_FAMILIES, live_pids, random_prompts, token_ids

from llmctl.engine import LLM, SamplingParams

GREEDY_24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [3, 7, 12, 20, 31, 5, 16, 40]
# (tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel)
LAYOUTS = {"tp2": (2, 1, False), "pp2": (1, 2, False), "ep2": (2, 1, True)}
CASES = [(f, layout) for f in NEW_FAMILIES for layout in ("tp2", "pp2")] + [("gpt-oss", "ep2")]


def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_models, hf_greedy):
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            _, hf_model = tiny_models.get(family)
            cache[family] = [hf_greedy(hf_model, p, 24) for p in prompts()]
        return cache[family]

    return get


def _llm(path, **kwargs) -> LLM:
    return LLM(
        str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05, **kwargs
    )


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_batch_of_8_matches_transformers(family, tiny_models, expected):
    """On the CPU backend, whose fused decode stack steps aside for what it cannot run: Qwen3's
    q/k norm, Phi-3's LongRoPE, gpt-oss's sinks and experts (a layer it refuses); Gemma 3 is not
    offered to it."""
    llm = _llm(tiny_models.path(family))
    assert token_ids(llm.generate(prompts(), GREEDY_24, use_tqdm=False)) == expected(family)
    runner = llm.llm_engine.executor.worker.model_runner
    if family == "gemma3":
        assert runner.fused_decode is None
    else:
        stack = runner.model.model.__dict__.get("_fused_decode_stack")
        assert runner.fused_decode is not None and type(stack).__name__ == "_NoStack"


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_layouts_on_mp_match_transformers(family, layout, tiny_models, expected):
    tp, pp, ep = LAYOUTS[layout]
    before = live_pids(parent=os.getpid())
    with _llm(
        tiny_models.path(family),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_expert_parallel=ep,
        distributed_executor_backend="mp",
    ) as llm:
        assert len(llm.llm_engine.executor.rank_info()) == tp * pp
        outputs = llm.generate(prompts(), GREEDY_24, use_tqdm=False)
    assert live_pids(parent=os.getpid()) <= before  # every worker process is gone
    assert token_ids(outputs) == expected(family)


def test_sliding_blocks_are_freed_so_more_requests_run_at_once(tiny_models, expected, caplog):
    """gpt-oss's 2 sliding and 2 full layers make two KV cache groups. The 8 requests (27 to 64
    tokens) hold 23 blocks of 16 in the full group at the end, and at most 2 each in the sliding
    one once their prefill is done: 40 blocks run all 8 at once, where keeping every block
    would need 46. Same tokens as transformers, nothing preempted, nothing left held."""
    with caplog.at_level(logging.INFO, logger="llmctl"):
        llm = LLM(
            str(tiny_models.path("gpt-oss")),
            use_tqdm_on_load=False,
            dtype="float32",
            max_model_len=64,
            num_gpu_blocks_override=40,
        )
    assert "KV cache groups: 2 (2 layers window 12, 2 layers full)" in caplog.text
    # 40 blocks; a 64-token request holds 64 tokens of each group at most (a step's prefill)
    assert "Maximum concurrency for 64 tokens per request: 5.00x" in caplog.text
    engine = llm.llm_engine
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY_24)
    most_running, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        most_running = max(most_running, engine.get_stats().num_running)
    stats = engine.get_stats()
    assert most_running == 8 and stats.num_preemptions == 0 and stats.kv_cache_usage == 0.0
    got = [outputs[str(i)].outputs[0].token_ids for i in range(8)]
    assert got == expected("gpt-oss")


def test_prefix_hits_and_preemption_with_sliding_groups(tiny_models, hf_greedy):
    """Gemma 3's three KV cache groups (two sliding, one full): a shared 48-token prefix is found
    in all of them (a sliding group needs only the blocks inside its window before the hit), and
    a cache too small for every request at once preempts and recomputes; same tokens."""
    path, hf_model = tiny_models.get("gemma3")
    shared = random_prompts([48], seed=13)[0]
    batch = [shared + tail for tail in random_prompts([9, 5, 3, 7], seed=14)]
    llm = LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        max_model_len=96,
        num_gpu_blocks_override=20,
    )
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = llm.generate(batch[:1], one, use_tqdm=False)
    rest = llm.generate(batch[1:], GREEDY_24, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [48, 48, 48]
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert token_ids(first) == [hf_greedy(hf_model, batch[0], 1)]
    assert token_ids(rest) == [hf_greedy(hf_model, p, 24) for p in batch[1:]]


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] float -> MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32], as
    OpenAI's checkpoints store an expert matrix (each group's largest value at most 6 x 2^e)."""
    from llmctl.engine.models.gpt_oss import _FP4_VALUES

    lut = torch.tensor(_FP4_VALUES)
    groups = w.transpose(1, 2).reshape(*w.shape[:1], w.shape[2], -1, 32)  # [E, out, G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6))
    codes = (groups / torch.exp2(exponent)[..., None] - lut[:8].view(8, 1, 1, 1, 1)).abs()
    codes = codes.argmin(0) + 8 * (groups < 0)  # the nearest magnitude, the sign bit
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_an_mxfp4_checkpoint_runs_as_its_dequantized_weights(tiny_models, tmp_path):
    """gpt-oss as OpenAI publishes it: the experts as MXFP4 blocks and scales (quantized here
    from the tiny model). The engine dequantizes them as it reads them: the tokens of a float
    checkpoint holding the dequantized values, alone and over 2 expert-parallel ranks."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from llmctl.engine.models.gpt_oss import dequantize_mxfp4

    source = tiny_models.path("gpt-oss")
    state = load_file(str(source / "model.safetensors"))
    packed, dequantized = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(state[name])
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales)
    for directory, tensors in (("mxfp4", packed), ("float", dequantized)):
        shutil.copytree(
            source, tmp_path / directory, ignore=shutil.ignore_patterns("*.safetensors")
        )
        save_file(tensors, str(tmp_path / directory / "model.safetensors"))
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))

    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    few = prompts()[3:6]
    ran = {}
    for name, kwargs in [
        ("float", {}),
        ("mxfp4", {}),
        ("mxfp4-ep2", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ]:
        with _llm(tmp_path / name.split("-")[0], **kwargs) as llm:
            ran[name] = token_ids(llm.generate(few, short, use_tqdm=False))
    assert ran["mxfp4"] == ran["float"] == ran["mxfp4-ep2"]
