"""The sampler's top-k / top-p without a sort of the vocabulary (a top-k selection of the largest
k, then a sort of those k alone) keeps exactly the tokens the sort of every row keeps; it is
taken whenever every row has a top_k, and no sort of a vocabulary-wide row runs then."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmctl.engine.worker.sampler import _apply_top_k_top_p

VOCAB = 5000


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def _case(seed: int, rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    logits[0, :10] = 4.0  # ties at the threshold
    top_k = torch.randint(1, 60, (rows,), generator=g)
    top_p = torch.rand(rows, generator=g) * 0.9 + 0.05
    return logits, top_k, top_p


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("with_p", [False, True])
def test_the_top_k_path_keeps_what_the_sort_keeps(seed, with_p):
    logits, top_k, top_p = _case(seed)
    top_p = top_p if with_p else None
    fast = _apply_top_k_top_p(logits.clone(), top_k, top_p, int(top_k.max()))
    sorted_path = _apply_top_k_top_p(logits.clone(), top_k, top_p, VOCAB)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(sorted_path))
    kept = torch.isfinite(fast).sum(dim=-1)
    assert (kept >= 1).all() and (kept <= torch.maximum(top_k, torch.tensor(10))).all()


def test_small_k_selects_instead_of_sorting_the_vocabulary():
    logits, top_k, top_p = _case(9)
    with CountOps() as counter:
        _apply_top_k_top_p(logits, top_k, top_p, int(top_k.max()))
    assert counter.ops["aten::topk"] == 1 and counter.ops["aten::sort"] == 0
    with CountOps() as counter:  # a row without top-k: top-p sorts the whole row
        _apply_top_k_top_p(logits, None, top_p, 0)
    assert counter.ops["aten::sort"] == 1


def test_a_seeded_request_keeps_one_generator_until_it_finishes():
    import numpy as np

    from llmctl.engine.sampling_params import SamplingParams
    from llmctl.engine.worker.input_batch import InputBatch
    from llmctl.engine.worker.sampling_state import SamplingState

    batch = InputBatch(4, 64, 16)
    state = SamplingState(
        batch, torch.device("cpu"), VOCAB, lambda name, v, dtype=torch.int64: torch.as_tensor(v)
    )
    seeded, plain = SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)
    for req_id, params in (("s", seeded), ("p", plain)):
        state.add_request(req_id, params)
        batch.add_request(req_id, [1, 2, 3], 3, params, [0], 0, VOCAB)
    rows = np.array([batch.row_of["s"], batch.row_of["p"]])
    first = state.metadata(rows).generators
    state.add_request("s", seeded)  # back after a preemption: the same generator goes on
    second = state.metadata(rows).generators
    assert first[0] is second[0] is state.generators["s"] and first[1] is second[1] is None
    assert first[0].initial_seed() == 7
    state.remove_request("s")
    assert "s" not in state.generators
