"""Head, column and layer partitions for tensor and pipeline parallelism."""

from __future__ import annotations

import pytest

from llmctl.engine.distributed.partition import (
    HeadShard,
    head_shards,
    layer_partition,
    pipeline_shard,
    split_evenly,
    valid_tp_sizes,
)
from llmctl.engine.errors import ConfigError


def test_split_evenly():
    assert split_evenly(14, 3) == [5, 5, 4]
    assert split_evenly(1536, 2) == [768, 768]


def test_even_heads():
    assert head_shards(32, 8, 4) == [HeadShard(i * 8, 8, i * 2, 2) for i in range(4)]


def test_smollm2_on_tp2_splits_whole_kv_groups():
    # 9 heads, 3 KV heads: ranks get 2 and 1 KV groups = 6 and 3 query heads.
    assert head_shards(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]


def test_kv_heads_replicated_when_tp_exceeds_them():
    shards = head_shards(8, 2, 4)
    assert [s.num_kv_heads for s in shards] == [1, 1, 1, 1]
    assert [s.kv_start for s in shards] == [0, 0, 1, 1]
    assert [(s.q_start, s.num_q_heads) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # Every query head is computed exactly once, next to the KV head it reads.
    for s in head_shards(9, 3, 4):
        group = 9 // 3
        assert all(h // group == s.kv_start for h in range(s.q_start, s.q_start + s.num_q_heads))


def test_impossible_tp_names_the_valid_sizes():
    with pytest.raises(ConfigError) as err:
        head_shards(9, 3, 10)
    assert "tensor_parallel_size=10" in err.value.message
    assert "1, 2, 3, 4, 5, 6, 7, 8, 9" in err.value.hint
    assert "--pipeline-parallel-size" in err.value.hint
    assert valid_tp_sizes(4, 4) == [1, 2, 3, 4]


def test_layer_partition_follows_vllm():
    assert layer_partition(30, 4) == [7, 8, 8, 7]
    assert layer_partition(30, 2) == [15, 15]
    assert layer_partition(31, 2) == [16, 15]  # the remainder is not on the last stage
    assert layer_partition(30, 3, (10, 11, 9)) == [10, 11, 9]
    shard = pipeline_shard(30, 1, 3, (10, 11, 9))
    assert (shard.start_layer, shard.end_layer, shard.is_first, shard.is_last) == (
        10,
        21,
        False,
        False,
    )


def test_bad_layer_partitions():
    with pytest.raises(ConfigError) as err:
        layer_partition(30, 3, (10, 10, 9))
    assert "sum to 30" in err.value.hint
    with pytest.raises(ConfigError):
        layer_partition(3, 4)


def test_rank_mesh():
    from llmctl.engine.distributed import ranks

    assert ranks.reshape(2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ranks.tp_groups(2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ranks.pp_groups(2, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ranks.coord(6, 2, 4) == ranks.RankCoord(6, 1, 2)
    assert ranks.output_rank(2, 4) == 4
    assert ranks.output_rank(1, 2) == 0
