"""Mixtures of experts (Mixtral, Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE
with q/k norm), token-exact against Hugging Face transformers: alone and in a batch, through
preemption and prefix caching, and split every way the engine splits them (tensor parallel,
expert parallel, pipeline parallel, on mp processes and on Ray)."""

from __future__ import annotations

import logging
import os

import pytest
from support import MOE_FAMILIES, live_pids, random_prompts, token_ids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ConfigError

GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LENGTHS = [3, 9, 17, 30]


def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=5)


@pytest.fixture(scope="module")
def expected(tiny_models, hf_greedy):
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            _, hf_model = tiny_models.get(family)
            cache[family] = [hf_greedy(hf_model, p, 16) for p in prompts()]
        return cache[family]

    return get


def child_pids() -> set[int]:
    return live_pids(parent=os.getpid())


def run(path, **kwargs) -> list[list[int]]:
    before = child_pids()
    with LLM(
        str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05, **kwargs
    ) as llm:
        outputs = llm.generate(prompts(), GREEDY_16, use_tqdm=False)
    assert child_pids() <= before  # every worker process is gone
    return token_ids(outputs)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_alone_and_in_a_batch_match_transformers(family, tiny_models, expected):
    path = tiny_models.path(family)
    llm = LLM(str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)
    batch = token_ids(llm.generate(prompts(), GREEDY_16, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY_16, use_tqdm=False))[0] for p in prompts()]
    assert batch == expected(family)
    assert alone == expected(family)


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_preemption_and_prefix_caching_keep_outputs(family, tiny_models, hf_greedy):
    path, hf_model = tiny_models.get(family)
    shared = random_prompts([32], seed=6)[0]
    tails = random_prompts([14, 12, 10, 8, 6, 4], seed=7)
    batch = [shared + tail for tail in tails]
    # 5 blocks of 16 = 80 slots: one request of max_model_len=64 fits, six cannot run at once.
    llm = LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=5,
        enable_prefix_caching=True,
    )
    outputs = llm.generate(batch, GREEDY_16, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0  # the shared 32 tokens: 2 full blocks
    assert token_ids(outputs) == [hf_greedy(hf_model, p, 16) for p in batch]


# (family, layout): expert parallel on every family, tensor parallel on Mixtral and Qwen2-MoE
# (Qwen3-MoE's q/k norm is per head: its tensor-parallel attention runs in ep2 too); pipeline
# stages on Mixtral and on Qwen2-MoE (its dense layer 1 on the first stage, its MoE layer 2 on
# the second); tp x pp with and without expert parallelism.
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
    "ep2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True),
}
CASES = [(f, "ep2") for f in MOE_FAMILIES] + [
    ("mixtral", "tp2"),
    ("qwen2-moe", "tp2"),
    ("mixtral", "pp2"),
    ("qwen2-moe", "pp2"),
    ("mixtral", "tp2-pp2"),
    ("qwen3-moe", "ep2-pp2"),
]


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_layouts_on_mp_match_transformers(family, layout, tiny_models, expected):
    kwargs = LAYOUTS[layout]
    assert run(tiny_models.path(family), distributed_executor_backend="mp", **kwargs) == expected(
        family
    )


def test_expert_parallel_deals_uneven_experts_and_logs_them(tiny_models, expected, caplog):
    """8 experts on 3 ranks: 3 + 3 + 2, logged, each rank holding only its experts (the
    planner's count of each rank's weights, as loaded), and the tokens unchanged."""
    from llmctl.cluster.inventory import inventory_from_flags
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    path = tiny_models.path("mixtral")
    kwargs = dict(tensor_parallel_size=3, enable_expert_parallel=True)
    with caplog.at_level(logging.INFO, logger="llmctl"):
        with LLM(
            str(path),
            use_tqdm_on_load=False,
            dtype="float32",
            kv_cache_space_gib=0.05,
            distributed_executor_backend="mp",
            **kwargs,
        ) as llm:
            weights = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
            outputs = token_ids(llm.generate(prompts(), GREEDY_16, use_tqdm=False))
    assert "experts 0-2 on rank 0, 3-5 on rank 1, 6-7 on rank 2" in caplog.text
    assert outputs == expected("mixtral")
    plan = make_plan(
        load_model_spec(str(path)),
        inventory_from_flags(1, 3, 1),
        PlanOptions(device="cpu", kv_cache_space_gib=0.05, dtype="float32", **kwargs),
    )
    assert [r.weight_bytes for r in plan.ranks] == weights
    assert weights[2] < weights[0]  # two experts instead of three


RAY_CASES = [("qwen2-moe", "ep2"), ("mixtral", "tp2"), ("mixtral", "pp2"), ("mixtral", "tp2-pp2")]


def test_layouts_on_ray_match_transformers(tiny_models, expected):
    """tp=2, ep=2, pp=2 and tp=2 x pp=2 with Ray actors, on one Ray started here (the engines
    join it rather than each starting and stopping their own)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        for family, layout in RAY_CASES:
            tokens = run(
                tiny_models.path(family), distributed_executor_backend="ray", **LAYOUTS[layout]
            )
            assert tokens == expected(family), (family, layout)
            assert ray.is_initialized()  # the engines left the Ray they found running
    finally:
        ray.shutdown()


def test_expert_parallel_on_a_dense_model_is_refused_before_any_process(tiny_models):
    before = child_pids()
    with pytest.raises(ConfigError) as err:
        LLM(
            str(tiny_models.path("llama")),
            use_tqdm_on_load=False,
            tensor_parallel_size=2,
            enable_expert_parallel=True,
        )
    assert "expert parallelism needs a mixture-of-experts model" in err.value.message
    assert "LlamaForCausalLM" in err.value.message
    assert "--enable-expert-parallel" in err.value.hint
    assert child_pids() == before


def test_a_moe_gguf_file_is_refused_naming_the_fix(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    from llmctl.engine.errors import UnsupportedArchitectureError

    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-moe.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_context_length, 128),
        (writer.add_embedding_length, 64),
        (writer.add_block_count, 1),
        (writer.add_feed_forward_length, 32),
        (writer.add_head_count, 4),
        (writer.add_head_count_kv, 2),
        (writer.add_vocab_size, 256),
        (writer.add_expert_count, 4),
        (writer.add_expert_used_count, 2),
    ]:
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError) as err:
        LLM(str(path), use_tqdm_on_load=False)
    assert "mixture-of-experts model (4 experts)" in err.value.message
    assert "ffn_gate_exps" in err.value.message  # only the old one-tensor-per-expert layout
    assert "safetensors" in err.value.hint
