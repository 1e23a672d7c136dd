"""KVCacheLayout: how sliding-window and full-attention layers share the KV cache, and what one
request holds at most (pure): the engine, the block manager and the planner all read it."""

from __future__ import annotations

from llmctl.cluster.plan.catalog import CATALOG
from llmctl.engine.config.kv_cache_layout import KVCacheLayout

S, F = 128, None  # a sliding window of 128 tokens; full attention


def test_alike_layers_make_one_group_holding_every_layer():
    for windows in ([F] * 6, [S] * 6):
        layout = KVCacheLayout.for_layers(windows, 4096, 16)
        assert [g.layers for g in layout.groups] == [tuple(range(6))]
        assert layout.num_tensors(0, 6) == 6 and layout.num_tensors(2, 5) == 3
        assert layout.cache_tokens(100) == 1600


def test_a_window_the_context_never_exceeds_is_full_attention():
    layout = KVCacheLayout.for_layers([S, F, S, F], max_model_len=128, block_size=16)
    assert layout.sliding_windows == (None,)


def test_alternating_layers_share_tensors_pairwise():
    layout = KVCacheLayout.for_layers([S, F] * 12, 131072, 16)  # gpt-oss-20b
    assert layout.sliding_windows == (128, None)
    assert layout.groups[0].layers == tuple(range(0, 24, 2))
    # 12 shared tensors: layer 2j (sliding) and layer 2j + 1 (full) use tensor j
    assert layout.num_tensors(0, 24) == 12
    assert layout.placement(0, 24)[6] == (0, 3) and layout.placement(0, 24)[7] == (1, 3)
    # a pipeline stage of layers 12..23 has 6 of each
    assert layout.num_tensors(12, 24) == 6 and layout.placement(12, 24)[12] == (0, 0)


def test_five_sliding_to_one_global_split_into_groups_of_the_global_count():
    gemma = [S, S, S, S, S, F] * 10 + [S, S]  # Gemma-3-27B: 62 layers, 10 global
    layout = KVCacheLayout.for_layers(gemma, 131072, 16)
    sizes = sorted(len(g.layers) for g in layout.groups)
    assert sizes == [2, 10, 10, 10, 10, 10, 10] and layout.num_tensors(0, 62) == 10
    assert sum(w is None for w in layout.sliding_windows) == 1


def test_a_long_request_holds_its_window_in_sliding_groups():
    layout = KVCacheLayout.for_layers([S, F] * 12, 131072, 16)
    # full: 8192 blocks; sliding: the window and a step's 8192 new tokens, in blocks, plus one
    assert layout.request_blocks(131072, 8192) == 8192 + (-(-(127 + 8192) // 16) + 1)
    assert layout.request_blocks(100, 8192) == 2 * 7  # short: every block in both groups
    one_group = KVCacheLayout.for_layers([F] * 24, 131072, 16)
    blocks = 100_000
    gain = layout.max_concurrency(blocks, 131072, 8192) / (
        one_group.max_concurrency(blocks, 131072, 8192) / 2  # a block of 24 layers is two of 12
    )
    assert 1.8 < gain < 2.0


def test_catalog_models_group_as_their_configs_say():
    gemma = CATALOG["Gemma-3-27B"].shape
    assert sum(gemma.layer_sliding_window(i) is None for i in range(62)) == 10
    oss = CATALOG["gpt-oss-20b"].shape
    assert [oss.layer_sliding_window(i) for i in range(4)] == [128, None, 128, None]
