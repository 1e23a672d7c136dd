"""Quantized weights executed natively: GGUF blocks read in place and `--quantization int8|int4`,
each against llmctl's float path on the same (dequantized) weights; tensor and pipeline
parallelism with quantized weights; the typed errors of bad input.

Tokens must be identical, or, where accumulation order parts them, the reference's logit gap
between the two choices at the first differing position must be below 1e-3 (printed).
"""

from __future__ import annotations

import numpy as np
import pytest
from support import assert_same_greedy, random_prompts

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ConfigError, UnsupportedQuantizationError

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
TINY = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02, max_model_len=128)


def generate(llm: LLM, prompts) -> list:
    with llm:
        return llm.generate(prompts, GREEDY_32, use_tqdm=False)


def write_tiny_gguf(
    path, *, types: dict[str, str] | None = None, layers: int = 2, hidden: int = 64
) -> None:
    """A tiny Llama GGUF with random weights and no tokenizer: token_embd Q8_0 (tied to the LM
    head, no output tensor), attention and MLP Q4_1, attn_v Q8_0 (a fused QKV of two formats),
    ffn_down Q4_0; `types` overrides a tensor's type by its name's suffix ("default": the rest)."""
    import gguf

    vocab, heads, kv_heads, ffn = 256, 4, 2, 2 * hidden
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    shapes = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    chosen = {"token_embd": "Q8_0", "attn_v": "Q8_0", "ffn_down": "Q4_0"} | (types or {})
    for name, shape in shapes.items():
        kind = name.split(".")[-2]
        qtype = gguf.GGMLQuantizationType[chosen.get(kind, chosen.get("default", "Q4_1"))]
        data = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if qtype.name in ("Q4_K", "Q6_K", "Q5_1"):
            raw = random_blocks(rng, qtype.name, shape)
        else:
            raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, hidden).astype("f4"))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_blocks(rng, type_name: str, shape) -> np.ndarray:
    """Random blocks of a type gguf.quants cannot quantize to: random bytes, with the f16 super-
    block scales set to small finite values (Q5_1: any bytes, only its refusal is tested)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scale = lambda n: rng.uniform(0.001, 0.01, (shape[0], shape[1] // block, n))  # noqa: E731
    if type_name == "Q4_K":  # d, dmin (f16), scales[12], qs[128]
        raw[..., 0:4] = scale(2).astype(np.float16).view(np.uint8)
    elif type_name == "Q6_K":  # ql[128], qh[64], scales int8[16], d (f16)
        raw[..., 208:210] = scale(1).astype(np.float16).view(np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMCTL_CACHE_DIR", str(root / "cache"))  # the workers inherit it
        path = root / "tiny-q4.gguf"
        write_tiny_gguf(path)
        yield path


def tiny_prompts() -> list[list[int]]:
    return [[t % 256 for t in p] for p in random_prompts([3, 9, 17, 30])]


def test_tiny_gguf_runs_its_blocks_natively_as_the_float_path(tiny_gguf):
    llm = LLM(str(tiny_gguf), skip_tokenizer_init=True, **TINY)
    config = llm.llm_engine.config.model_config
    assert config.quantization.method == "gguf"
    assert config.quantization.gguf_types == ("Q4_0", "Q4_1", "Q8_0")
    native = generate(llm, tiny_prompts())
    reference_llm = LLM(str(tiny_gguf), skip_tokenizer_init=True, gguf_dequantize=True, **TINY)
    assert reference_llm.llm_engine.config.model_config.quantization is None
    assert_same_greedy(native, generate(reference_llm, tiny_prompts()))


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tiny_gguf_tensor_and_pipeline_parallel_equal_tp1(tiny_gguf, layout):
    tp, pp = layout
    one = generate(LLM(str(tiny_gguf), skip_tokenizer_init=True, **TINY), tiny_prompts())
    split = LLM(
        str(tiny_gguf),
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        **TINY,
    )
    assert_same_greedy(generate(split, tiny_prompts()), one)


def rtn_reference_checkpoint(model, path, bits: int) -> None:
    """Save `model` with every decoder-layer linear weight replaced by its int`bits` RTN
    round trip: the float weights the quantized engine computes with."""
    import torch

    from llmctl.engine.layers.quantization.linear_method import dequantize_groups, quantize_rtn

    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, w in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, scales, zeros = quantize_rtn(w, bits, 32)
            state[name] = dequantize_groups(q, scales, zeros, 32).to(w.dtype)
    with torch.no_grad():
        model_copy = type(model)(model.config)
        model_copy.load_state_dict(state)
    model_copy.save_pretrained(path)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_flag_matches_float_on_the_rtn_weights(tiny_models, tmp_path, method):
    path, hf_model = tiny_models.get("llama")
    prompts = random_prompts([3, 9, 17, 30])
    llm = LLM(str(path), quantization=method, **TINY)
    assert llm.llm_engine.config.model_config.quantization.method == method
    native = generate(llm, prompts)
    rtn_reference_checkpoint(hf_model, tmp_path / "rtn", int(method[3:]))
    tiny_models.tokenizer.save_pretrained(tmp_path / "rtn")
    assert_same_greedy(native, generate(LLM(str(tmp_path / "rtn"), **TINY), prompts))


def test_tiny_q4_k_m_gguf_runs_natively_as_the_float_path(tmp_path, tiny_gguf):
    # Q4_K_M's mix: Q4_K, with Q6_K for the embedding, attn_v and ffn_down (K a multiple of 256).
    path = tmp_path / "tiny-q4_k_m.gguf"
    types = {"default": "Q4_K", "token_embd": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}
    write_tiny_gguf(path, types=types, hidden=256)
    llm = LLM(str(path), skip_tokenizer_init=True, **TINY)
    assert llm.llm_engine.config.model_config.quantization.gguf_types == ("Q4_K", "Q6_K")
    native = generate(llm, tiny_prompts())
    reference = LLM(str(path), skip_tokenizer_init=True, gguf_dequantize=True, **TINY)
    assert_same_greedy(native, generate(reference, tiny_prompts()))
    # Its 256-weight blocks: tp=2 would give each rank 128 attention features of o_proj.
    with pytest.raises(ConfigError) as err:
        LLM(str(path), skip_tokenizer_init=True, tensor_parallel_size=2, **TINY)
    assert "GGUF blocks of 256" in err.value.message
    assert "use tensor_parallel_size 1," in err.value.hint


def test_quantization_flag_on_a_quantized_gguf_is_refused(tiny_gguf):
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_gguf), skip_tokenizer_init=True, quantization="int8", **TINY)
    assert "already quantized" in err.value.message
    assert "drop --quantization" in err.value.hint


def test_a_tensor_parallel_split_inside_a_group_is_refused(tiny_models):
    # The tiny Llama's 4 heads of 16: tp=4 gives each rank 16 attention features of o_proj,
    # half a group of 32.
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_models.path("llama")), quantization="int4", tensor_parallel_size=4, **TINY)
    assert "tensor_parallel_size=4" in err.value.message and "32" in err.value.message
    assert "use tensor_parallel_size 1, 2" in err.value.hint


def test_an_unsupported_gguf_type_names_the_supported_ones(tmp_path, tiny_gguf):
    path = tmp_path / "tiny-q5_1.gguf"
    write_tiny_gguf(path, types={"ffn_up": "Q5_1"}, layers=1)
    with pytest.raises(UnsupportedQuantizationError) as err:
        LLM(str(path), skip_tokenizer_init=True, **TINY)
    assert "Q5_1" in err.value.message
    for supported in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        assert supported in err.value.hint


@pytest.mark.slow
def test_bundled_q4_1_model_natively_matches_its_dequantized_weights():
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "The three primary colors are",
    ]
    common = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.1)
    llm = LLM(max_model_len=256, **common)
    assert llm.llm_engine.config.model_config.quantization.gguf_types == ("Q4_1", "Q8_0")
    native = generate(llm, prompts)
    reference = generate(LLM(max_model_len=256, gguf_dequantize=True, **common), prompts)
    assert_same_greedy(native, reference)


def test_quantized_tensors_narrow_rows_and_whole_blocks_only(tiny_gguf):
    import torch

    from llmctl.engine.model_loader.gguf_file import iterate_gguf_weights

    native = dict(iterate_gguf_weights(tiny_gguf, "llama", 4, 2))
    floats = dict(iterate_gguf_weights(tiny_gguf, "llama", 4, 2, dequantize=True))
    down = native["model.layers.0.mlp.down_proj.weight"]  # Q4_0 [64, 128]
    assert (down.type_name, down.shape) == ("Q4_0", (64, 128))
    full = floats["model.layers.0.mlp.down_proj.weight"].load()
    assert torch.equal(down.narrow(0, 3, 5).narrow(1, 32, 64).load(), full[3:8, 32:96])
    with pytest.raises(ConfigError) as err:
        down.narrow(1, 16, 32)
    assert "32-weight blocks" in err.value.message
    # attn_q's rows are un-permuted (llama.cpp interleaves each head's rotary halves).
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(native[q_proj].narrow(0, 16, 16).load(), floats[q_proj].load()[16:32])
