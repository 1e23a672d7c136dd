"""Each rank's weight bytes in the format its weights are stored in: float dtypes, GGUF blocks, and
--quantization's groups (pure: no torch)."""

from __future__ import annotations

import math

import pytest

from llmctl.cluster.plan.catalog import CATALOG
from llmctl.cluster.plan.model_spec import spec_from_gguf
from llmctl.cluster.plan.weight_format import (
    QUANTIZATION_SCHEMES,
    WeightFormats,
    dense_format,
    quantization_format,
)
from llmctl.engine.distributed.partition import layer_partition, valid_tp_sizes
from llmctl.engine.errors import ConfigError
from llmctl.engine.layers.quantization.gguf_quants import (
    PACKED_FORMATS,
    packed_nbytes,
    scale_bytes,
)
from llmctl.engine.model_loader.default_model import default_model_path
from llmctl.engine.model_loader.gguf_file import read_gguf_tensors

BF16 = dense_format("bfloat16", 2)


def _stages(num_layers: int, pp: int) -> list[tuple[int, int]]:
    parts = layer_partition(num_layers, pp)
    starts = [sum(parts[:i]) for i in range(pp)]
    return [(s, s + n) for s, n in zip(starts, parts, strict=True)]


@pytest.mark.parametrize("name", list(CATALOG))
def test_float_bytes_are_the_parameter_count_times_the_dtype(name):
    """Two bytes a parameter of each stage's layers, DeepSeek's and GLM-4.5's routing biases
    (float32 whatever the dtype) four."""
    shape = CATALOG[name].shape
    weights = WeightFormats(BF16)
    for tp in valid_tp_sizes(shape.num_attention_heads, shape.num_kv_heads)[:4]:
        for pp in (1, 3):
            for stage, span in enumerate(_stages(shape.num_layers, pp)):
                first, last = stage == 0, stage == pp - 1
                moe_layers = sum(shape.is_moe_layer(i) for i in range(*span))
                biases = moe_layers * shape.num_experts if shape.expert_score_bias else 0
                for tp_rank in range(tp):
                    params = shape.rank_params(
                        span[1] - span[0], tp_rank, tp, is_first=first, is_last=last, start=span[0]
                    )
                    got = weights.rank_bytes(shape, span, tp_rank, tp, is_first=first, is_last=last)
                    assert got == 2 * params + 2 * biases, (tp, pp, stage, tp_rank)


def test_quantization_bytes_per_weight():
    # Nibbles + a float32 scale and zero per 32 weights; bytes + a float32 scale per 32 weights.
    assert quantization_format("int4").bytes_per_weight == 0.5 + 8 / 32
    assert quantization_format("int8").bytes_per_weight == 1 + 4 / 32
    # FP8: a byte a weight, each row a float32 scale per block of 128 inputs (a partial block too)
    fp8 = quantization_format("fp8")
    assert fp8.nbytes(300, 200) == 300 * 200 + 300 * 2 * 4
    with pytest.raises(ConfigError) as err:
        quantization_format("fp4")
    assert err.value.hint == "use --quantization int8 or int4 or fp8"


def test_quantization_holds_the_linears_in_groups_and_the_rest_in_the_dtype():
    shape = CATALOG["Llama-3.1-8B"].shape
    quantized = WeightFormats.for_quantization(BF16, "int4")
    whole = dict(is_first=True, is_last=True)
    total = quantized.rank_bytes(shape, (0, shape.num_layers), 0, 1, **whole)
    embedding_and_head = 2 * shape.vocab_size * shape.hidden_size  # untied, in bfloat16
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    linears = h * (q + 2 * kv) + q * h + 3 * h * inter
    norms = 2 * h * shape.num_layers + h
    expected = linears * shape.num_layers * 3 // 4 + 2 * (embedding_and_head + norms)
    assert total == expected
    assert quantized.label() == "int4"
    assert quantized.detail(shape) == "int4 (q, k, v, o, gate, up, down), bfloat16 (the rest)"


@pytest.fixture(scope="module")
def bundled():
    """The bundled GGUF's ModelSpec, and the bytes the engine holds for each of its tensors:
    quantized ones repacked (PACKED_FORMATS), float ones in float32."""
    path = default_model_path()
    held = {}
    for t in read_gguf_tensors(path):
        rows, cols = (t.shape[0], math.prod(t.shape[1:])) if len(t.shape) > 1 else (t.shape[0], 1)
        if t.type_name == "F32":
            held[t.name] = (4 * rows * cols, False)
        else:
            bits_group = PACKED_FORMATS[t.type_name]
            held[t.name] = (packed_nbytes(rows, cols, *bits_group, scale_bytes(t.type_name)), True)
    return spec_from_gguf(path, str(path)), held


def test_bundled_gguf_bytes_are_what_the_engine_packs(bundled):
    """SmolLM2-135M Q4_1: Q4_1 linears, a Q8_0 (tied) embedding, float32 norms; the engine
    repacks Q4_1 into 4-bit groups of 32 with the file's float16 scale and zero, Q8_0 into
    8-bit groups with its float16 scale (tests/engine/test_plan_predictions.py checks these
    against a loaded engine)."""
    spec, held = bundled
    shape, weights = spec.shape, spec.weight_formats
    nbytes = {name: n for name, (n, _) in held.items()}
    assert weights.label() == "Q4_1 GGUF"
    assert weights.detail(shape) == (
        "Q8_0 (embedding), Q4_1 (q, k, v, o, gate, up, down), float32 (the rest)"
    )
    layers = shape.num_layers

    # tp=1, pp=1: every tensor once (the tied LM head is the embedding's packed weight).
    whole = weights.rank_bytes(shape, (0, layers), 0, 1, is_first=True, is_last=True)
    assert whole == sum(nbytes.values())

    # pp=2: layers 0-14 and the embedding; layers 15-29, the final norm and a copy of the tied
    # embedding as the LM head.
    first = weights.rank_bytes(shape, (0, 15), 0, 1, is_first=True, is_last=False)
    last = weights.rank_bytes(shape, (15, layers), 0, 1, is_first=False, is_last=True)

    def blocks(start: int, end: int) -> int:
        return sum(n for name, n in nbytes.items() if name.startswith("blk.")
                   and start <= int(name.split(".")[1]) < end)  # fmt: skip

    assert first == blocks(0, 15) + nbytes["token_embd.weight"]
    assert last == blocks(15, layers) + nbytes["output_norm.weight"] + nbytes["token_embd.weight"]

    # tp=3 (9 heads on 3 KV heads, 1536 MLP features, 49152 tokens: all divide by 3): every
    # matrix a third on each rank, the norms whole.
    split = sum(n for name, (n, quantized) in held.items() if quantized)
    replicated = sum(n for name, (n, quantized) in held.items() if not quantized)
    assert split % 3 == 0
    for tp_rank in range(3):
        got = weights.rank_bytes(shape, (0, layers), tp_rank, 3, is_first=True, is_last=True)
        assert got == split // 3 + replicated


def test_a_split_that_cuts_quantization_groups_names_the_valid_sizes(bundled):
    spec, _ = bundled
    shape = spec.shape
    valid = valid_tp_sizes(shape.num_attention_heads, shape.num_kv_heads)
    # tp=5 gives down_proj 308 or 307 of its 1536 inputs: Q4_1's 32-weight blocks are cut.
    assert spec.weight_formats.cut_groups(shape, 5) == ["down (308 of 1536 inputs; groups of 32)"]
    with pytest.raises(ConfigError) as err:
        spec.weight_formats.check_split(shape, 5, valid)
    assert err.value.message.startswith("tensor_parallel_size=5 cuts the quantization groups")
    assert err.value.hint == "use tensor_parallel_size 1, 2, 3, 4, 6, 8, or pipeline parallel"
    # In float nothing is cut.
    assert WeightFormats(BF16).cut_groups(shape, 5) == []
    assert set(QUANTIZATION_SCHEMES) == {"int8", "int4"}


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "Llama-3.1-8B", "Llama-2-13B"])
def test_the_plan_splits_quantized_weights_where_the_engine_does(name):
    from llmctl.engine.layers.quantization.quant_config import valid_group_tp_sizes

    shape = CATALOG[name].shape
    weights = WeightFormats.for_quantization(BF16, "int4")
    valid = valid_tp_sizes(shape.num_attention_heads, shape.num_kv_heads)
    planned = [tp for tp in valid if not weights.cut_groups(shape, tp)]
    assert planned == valid_group_tp_sizes(shape, QUANTIZATION_SCHEMES["int4"].group_size)
