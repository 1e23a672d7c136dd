"""Block-FP8 checkpoints read as they ship (tests/fp8_checkpoints.py writes tiny Llama,
Qwen3-MoE and DeepSeek-V3 ones from their own tensors, hidden 192: partial edge blocks): greedy
tokens equal transformers' on the same weights dequantized, alone and at tp=2; the packed weights
hold a byte a weight plus a float32 scale per row and block; `--quantization fp8` on the float
checkpoint is the same model; a split cutting a block, an integer scheme on an FP8 checkpoint and
a per-tensor FP8 checkpoint are refused before any process starts."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from fp8_checkpoints import fp8_configs, write_fp8
from support import live_pids, random_prompts, spread_routers, token_ids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ConfigError, UnsupportedQuantizationError

GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts([3, 17, 30, 9], seed=5)
COMMON = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02, max_model_len=128)
FAMILIES = ["llama", "qwen3-moe", "deepseek-v3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smol_tokenizer, hf_greedy):
    """family -> (float dir, FP8 dir, transformers' tokens on the dequantized weights)."""
    from transformers import AutoModelForCausalLM

    root, made = tmp_path_factory.mktemp("fp8"), {}

    def get(family: str):
        if family not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(fp8_configs()[family]).eval()
            spread_routers(model)
            paths = [root / f"{family}-{kind}" for kind in ("float", "fp8", "dequantized")]
            model.save_pretrained(paths[0])
            smol_tokenizer.save_pretrained(paths[0])
            write_fp8(*paths)
            oracle = AutoModelForCausalLM.from_pretrained(paths[2], dtype=torch.float32).eval()
            made[family] = (paths[0], paths[1], [hf_greedy(oracle, p, 16) for p in PROMPTS])
        return made[family]

    return get


def run(path, **kwargs):
    """(tokens, the engine's LLM kept for inspection is closed; each rank's weight bytes)."""
    backend = {"distributed_executor_backend": "mp"} if kwargs else {}
    with LLM(str(path), **COMMON, **kwargs, **backend) as llm:
        weights = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
        tokens = token_ids(llm.generate(PROMPTS, GREEDY_16, use_tqdm=False))
    return tokens, weights


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(family, checkpoints):
    _, fp8, expected = checkpoints(family)
    tokens, _ = run(fp8)
    assert tokens == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_split_whole_blocks_and_match(family, checkpoints):
    _, fp8, expected = checkpoints(family)
    tokens, weights = run(fp8, tensor_parallel_size=2)
    assert tokens == expected
    assert weights[0] == weights[1]  # 128-row halves of every split layer


def fp8_bytes(n: int, k: int) -> int:
    """What the engine holds for an [n, k] FP8 weight: a byte a weight, a float32 scale per row
    and block of 128 inputs."""
    return n * k + 4 * n * math.ceil(k / 128)


def test_packed_weights_are_fp8_sized(checkpoints):
    from safetensors import safe_open

    _, fp8, _ = checkpoints("llama")
    llm = LLM(str(fp8), **COMMON)
    model = llm.llm_engine.executor.worker.model_runner.model
    packed = {
        name: module.quant_method.nbytes
        for name, module in model.named_modules()
        if getattr(module, "quant_method", None) is not None
    }
    llm.shutdown()
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys() if n.endswith("_proj.weight")}
    assert sum(packed.values()) == sum(fp8_bytes(*shape) for shape in shapes.values())
    float_bytes = 2 * sum(n * k for n, k in shapes.values())  # the same weights in bfloat16
    assert sum(packed.values()) < 0.52 * float_bytes
    assert len(packed) == 4 * 2  # qkv, o, gate_up, down of both layers


def test_quantization_fp8_on_the_float_checkpoint_is_the_same_model(checkpoints):
    float_dir, fp8, _ = checkpoints("llama")
    from_float, weights_float = run(float_dir, quantization="fp8", tensor_parallel_size=2)
    from_fp8, weights_fp8 = run(fp8, tensor_parallel_size=2)
    assert from_float == from_fp8  # per-block round-to-nearest, as the checkpoint was written
    assert weights_float == weights_fp8


def test_a_split_that_cuts_a_block_is_refused_naming_the_sizes(tiny_models):
    before = live_pids(parent=os.getpid())
    with pytest.raises(ConfigError) as err:  # 4 heads of 16: 32 query rows per rank
        LLM(str(tiny_models.path("llama")), quantization="fp8", tensor_parallel_size=2, **COMMON)
    assert "tensor_parallel_size=2 would cut the 128x128 FP8 blocks" in err.value.message
    assert "q_proj rows [0, 32) of 64" in err.value.message
    assert "tensor_parallel_size 1" in err.value.hint
    assert live_pids(parent=os.getpid()) == before


def test_an_integer_scheme_on_an_fp8_checkpoint_is_refused(checkpoints):
    _, fp8, _ = checkpoints("llama")
    with pytest.raises(ConfigError) as err:
        LLM(str(fp8), quantization="int4", **COMMON)
    assert "ships in FP8 already" in err.value.message
    assert "drop --quantization" in err.value.hint


def test_a_per_tensor_fp8_checkpoint_is_refused(checkpoints, tmp_path):
    _, fp8, _ = checkpoints("llama")
    path = tmp_path / "per-tensor"
    shutil.copytree(fp8, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].pop("weight_block_size")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError) as err:
        LLM(str(path), **COMMON)
    assert "not per-tensor scales" in err.value.message
    assert "--quantization fp8" in err.value.hint
