"""ModelCost (engine/benchmarks/roofline.py) against independent counts on tiny real models: the
bytes a decode step reads are the loaded weights (the token embedding's table apart, unless it is
the tied LM head) plus the KV cache; a prefill's matmul FLOPs are what torch's FlopCounterMode
counts in transformers' own forward of the same model."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.benchmarks.roofline import ModelCost
from llmctl.engine.config.engine_args import EngineArgs


def _config(path, **kwargs):
    return EngineArgs(
        model=str(path), device="cpu", dtype="float32", **kwargs
    ).create_engine_config()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2's tiny model ties its embeddings
def test_decode_bytes_are_the_weights_read_and_the_kv_cache(tiny_models, family):
    path, hf = tiny_models.get(family)
    config = _config(path)
    shape = config.model_config.shape
    weights = sum(p.numel() for p in hf.parameters())  # tied parameters once
    embedding = hf.get_input_embeddings().weight.numel()
    read = weights if shape.tie_word_embeddings else weights - embedding
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4

    cost = ModelCost.from_config(config)

    assert cost.decode_step_bytes([]) == 4 * read
    # two sequences with 10 and 30 tokens cached: both read, one new token each written
    assert cost.decode_step_bytes([10, 30]) == 4 * read + kv_per_token * 42
    assert cost.decode_bytes([10, 30], 3) == cost.decode_step_bytes(
        [10, 30]
    ) + cost.decode_step_bytes([11, 31])


def test_the_engine_reported_weight_bytes_replace_the_shape_count(tiny_models):
    config = _config(tiny_models.path("llama"))
    shape = config.model_config.shape
    embedding_bytes = 4 * shape.vocab_size * shape.hidden_size
    held = 1_000_000 + embedding_bytes  # e.g. quantized weights: fewer bytes than the shape says

    cost = ModelCost.from_config(config, [{"pp_rank": 0, "tp_rank": 0, "weight_bytes": held}])

    assert cost.decode_step_bytes([]) == 1_000_000


def test_prefill_matmul_flops_equal_transformers_forward(tiny_models):
    from torch.utils.flop_counter import FlopCounterMode

    path, hf = tiny_models.get("llama")
    config = _config(path)
    shape = config.model_config.shape
    length = 24
    ids = torch.randint(5, shape.vocab_size, (1, length))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        hf(ids, logits_to_keep=1)  # logits of the last token, as the engine samples
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counts.items() if str(op).split(".")[-1] in ("mm", "addmm"))
    pairs = length * (length + 1) // 2
    attention = 4 * shape.head_dim * shape.num_attention_heads * shape.num_layers * pairs

    assert ModelCost.from_config(config).prefill_flops([length]) == matmuls + attention


def test_a_mixture_of_experts_reads_the_experts_its_tokens_reach(tiny_models):
    config = _config(tiny_models.path("mixtral"))
    shape = config.model_config.shape
    cost = ModelCost.from_config(config)
    expert_bytes = (
        4
        * shape.num_layers
        * shape.num_experts
        * 3
        * shape.hidden_size
        * (shape.expert_intermediate_size)
    )
    one = cost.decode_step_bytes([8]) - cost.decode_step_bytes([])
    many = cost.decode_step_bytes([8] * 64) - cost.decode_step_bytes([])
    k, e = shape.num_experts_per_tok, shape.num_experts
    kv_per_token = cost.stages[0].kv_bytes_per_token
    assert one == pytest.approx(expert_bytes * k / e + kv_per_token * 9, rel=1e-6)
    # 64 tokens reach nearly every expert
    assert many == pytest.approx(
        expert_bytes * (1 - (1 - k / e) ** 64) + kv_per_token * 576, rel=1e-6
    )
