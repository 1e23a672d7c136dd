"""The engine's Triton attention path end to end: LLM generating on tiny models with
LLMCTL_ATTENTION_BACKEND=triton, token-exact against transformers. Without a GPU the kernels
run in Triton's interpreter on CPU tensors (conftest.py), through the same custom ops, metadata
and step layout (decodes, prefill chunks after a prefix hit, chunked prefill) as on CUDA."""

from __future__ import annotations

import pytest
import torch
from support import generate_in_new_thread, random_prompts, token_ids

from llmctl.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", "triton")


def _llm(path, **kw) -> LLM:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return LLM(str(path), use_tqdm_on_load=False, dtype="float32", device=device, **kw)


# llama: GQA; mistral: sliding window (tiny config: 24 tokens) passed by the 40-token prompt;
# qwen2: QKV bias, tied embeddings; gpt2: learned positions, no GQA; issue 34's families
# (tests/support.py new_family_configs): qwen3's q/k norm, gemma3's three KV cache groups (two
# sliding, windows of 12), phi3's LongRoPE (the 40-token prompt past its 32), gpt-oss's sinks
# in every kernel and its two groups.
@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen2", "gpt2", "qwen3", "gemma3", "phi3", "gpt-oss"]
)
def test_generate_matches_transformers(family, tiny_models, hf_greedy, monkeypatch):
    """With the layers' fused kernels too (RMSNorm with its residual add in place, rotary in
    place on views of the QKV output, SiLU-and-mul), as on the GPU, where they run wherever CUDA
    tensors are: here they are switched on for CPU tensors and run in the interpreter. Every
    such layer ran its kernel but phi3's LongRoPE rotary, which has none; gpt2 has no such
    layer (LayerNorm, GELU), gemma3 only its rotaries (its norms and GELU-tanh have none)."""
    from llmctl.engine.layers import activation, layernorm, rotary_embedding

    for module in (activation, layernorm, rotary_embedding):
        monkeypatch.setattr(module, "use_fused_kernels", lambda x: True)
    path, hf_model = tiny_models.get(family)
    prompts = random_prompts([3, 17, 40], seed=5)
    llm = _llm(path, num_gpu_blocks_override=32, max_num_batched_tokens=24)  # 40 -> 24 + 16
    outputs = generate_in_new_thread(llm, prompts, GREEDY)
    model = llm.llm_engine.executor.worker.model_runner.model
    layers = [m for m in model.modules() if hasattr(m, "_fused")]  # norms, rotaries, SiLU-and-mul
    assert bool(layers) == (family != "gpt2")
    unfused = [type(m).__name__ for m in layers if not m._fused]
    assert unfused == (["LongRopeRotaryEmbedding"] if family == "phi3" else [])
    assert token_ids(outputs) == [hf_greedy(hf_model, p, 6) for p in prompts]


def test_prefix_hit_matches_transformers(tiny_models, hf_greedy):
    path, hf_model = tiny_models.get("qwen2")
    shared = random_prompts([32], seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([5, 11], seed=2)]
    llm = _llm(path, num_gpu_blocks_override=32)
    first = generate_in_new_thread(llm, prompts[:1], GREEDY)
    second = generate_in_new_thread(llm, prompts[1:], GREEDY)
    assert second[0].num_cached_tokens == 32
    assert token_ids(first + second) == [hf_greedy(hf_model, p, 6) for p in prompts]


def test_steps_padded_as_cuda_graphs_pad_them_match_transformers(tiny_models, hf_greedy):
    """The inputs CUDA graphs replay, run eagerly: every step padded as the graph runner pads it
    (decode steps to a batch size, steps with a prefill chunk to a token count with every
    sequence a chunk of the static max_num_seqs chunk rows, the rest empty), through the varlen
    and decode kernels in the interpreter; token-exact against transformers."""
    from llmctl.engine.worker.cuda_graph_runner import CudaGraphRunner

    path, hf_model = tiny_models.get("llama")
    prompts = random_prompts([3, 17, 9, 5, 2], seed=11)
    llm = _llm(path, num_gpu_blocks_override=32, max_num_batched_tokens=32, max_num_seqs=8)
    runner = llm.llm_engine.executor.worker.model_runner
    graphs = runner.cuda_graphs = CudaGraphRunner(runner)  # static inputs, nothing captured
    assert graphs.mixed_sizes == [16, 32]  # (up to max_num_batched_tokens)
    padded = []
    prepare = runner._prepare_inputs

    def recording(so):
        inputs = prepare(so)
        md = inputs.attn_metadata
        padded.append((inputs.input_ids.shape[0], so.total_num_scheduled_tokens, bool(md.prefills)))
        if md.prefills and inputs.input_ids.shape[0] in (16, 32):
            assert md.num_decodes == 0 and md.prefill_query_start_loc.shape == (9,)
        return inputs

    runner._prepare_inputs = recording
    outputs = generate_in_new_thread(llm, prompts, GREEDY)
    assert token_ids(outputs) == [hf_greedy(hf_model, p, 6) for p in prompts]
    assert any(mixed and size > tokens for size, tokens, mixed in padded)  # padded mixed
    assert any(not mixed and size > tokens for size, tokens, mixed in padded)  # padded decode
