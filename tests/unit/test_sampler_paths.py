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


def _greedy_metadata(rows: int, **extra):
    from llmctl.engine.worker.sampler import SamplingMetadata

    md = SamplingMetadata(None, None, True, None, None, None, [None] * rows)
    for name, value in extra.items():
        setattr(md, name, value)
    return md


def test_a_greedy_step_takes_the_argmax_of_bfloat16_logits_without_a_float_copy():
    from llmctl.engine.worker.sampler import Sampler

    logits = (torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    logits[1, 7] = logits[1, 4000] = logits[1].max()  # a tie: the first index
    with CountOps() as counter:
        sampled, stats = Sampler(None).sample(logits, _greedy_metadata(5))
    assert stats is None
    assert torch.equal(sampled, logits.float().argmax(dim=-1))
    assert int(sampled[1]) == 7
    assert counter.ops["aten::_to_copy"] == 0, counter.ops  # no float32 copy of the logits


def test_logprobs_of_bfloat16_logits_are_computed_in_float32():
    from llmctl.engine.worker.sampler import Sampler

    logits = (torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    sampler = Sampler(None)
    md = _greedy_metadata(3, num_logprobs=[2, None, 0])
    tokens, logprobs = sampler(logits.clone(), md)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    want = torch.log_softmax(logits.float(), dim=-1)
    assert logprobs[1] is None
    assert logprobs[0].sampled_logprob == pytest.approx(float(want[0, tokens[0]]), abs=1e-6)
    assert logprobs[0].top_logprobs[0] == pytest.approx(float(want[0].max()), abs=1e-6)
