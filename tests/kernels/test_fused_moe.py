"""FusedMoE against a naive per-token reference: routing (softmax, top-k, renormalized or not),
and the partial sums of every rank's slice (tensor parallel: a slice of every expert's features;
expert parallel: whole experts, 8 on 3 ranks as 3 + 3 + 2) adding up to the whole layer. Ranks
are simulated in one process with their group coordinates; the all-reduce is the test's sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.engine.distributed import parallel_state
from llmctl.engine.distributed.parallel_state import GroupCoordinator
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.fused_moe import FusedMoE, expert_param

HIDDEN, INTER, EXPERTS = 32, 24, 8


def reference(x, router, w1, w3, w2, top_k, renormalize):
    """Token by token: its top-k experts' SiLU-gated MLPs, weighted by the routing softmax."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ router.T, dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights.tolist(), ids.tolist(), strict=True):
            out[t] += weight * ((F.silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)) @ w2[e].T)
    return out


@pytest.fixture
def weights():
    g = torch.Generator().manual_seed(0)
    return {
        "router": torch.randn(EXPERTS, HIDDEN, generator=g),
        "w1": torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5,
        "w3": torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5,
        "w2": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5,
    }


@pytest.fixture(autouse=True)
def _one_rank_groups():
    yield
    parallel_state.reset_groups()


def build_rank(weights, rank, size, expert_parallel, top_k, renormalize):
    """Rank `rank` of `size`'s FusedMoE, loaded through its weight loader from per-expert
    checkpoint tensors (Mixtral's names)."""
    group = GroupCoordinator(ranks=list(range(size)), rank=rank)
    parallel_state.set_groups(group, GroupCoordinator(ranks=[0], rank=0))
    parallel_state.set_ep_group(group if expert_parallel else None)
    layer = FusedMoE(EXPERTS, top_k, HIDDEN, INTER, renormalize, reduce_results=False)
    params = dict(layer.named_parameters(prefix="model.layers.0.mlp.experts"))
    for e in range(EXPERTS):
        for role in ("w1", "w2", "w3"):
            name = f"model.layers.0.mlp.experts.{e}.{role}.weight"
            param_name, expert_id, shard_id = expert_param(name)
            param = params[param_name]
            tensor = CheckpointTensor.from_tensor(name, weights[role][e])
            param.weight_loader(param, tensor, shard_id, expert_id)
    return layer


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "size, expert_parallel",
    [(1, False), (2, False), (3, False), (2, True), (3, True)],
    ids=["one-rank", "tp2", "tp3-uneven", "ep2", "ep3-uneven"],
)
def test_ranks_partial_sums_match_the_reference(weights, size, expert_parallel, renormalize):
    top_k = 2
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    logits = x @ weights["router"].T
    expected = reference(
        x, weights["router"], weights["w1"], weights["w3"], weights["w2"], top_k, renormalize
    )
    layers = [
        build_rank(weights, r, size, expert_parallel, top_k, renormalize) for r in range(size)
    ]
    with torch.no_grad():
        total = sum(layer(x, logits) for layer in layers)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    if expert_parallel:  # whole experts, contiguous: 8 on 2 ranks 4 + 4, on 3 ranks 3 + 3 + 2
        held = [(layer.first_expert, layer.num_local_experts) for layer in layers]
        assert held == {2: [(0, 4), (4, 4)], 3: [(0, 3), (3, 3), (6, 2)]}[size]
        assert all(layer.w13_weight.shape[1] == 2 * INTER for layer in layers)
    else:  # a slice of every expert: 24 features on 3 ranks as 8 each
        assert all(layer.w13_weight.shape[0] == EXPERTS for layer in layers)
        assert sum(layer.w2_weight.shape[2] for layer in layers) == INTER


def test_renormalization_changes_the_output(weights):
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    logits = x @ weights["router"].T
    with torch.no_grad():
        on = build_rank(weights, 0, 1, False, 2, True)(x, logits)
        off = build_rank(weights, 0, 1, False, 2, False)(x, logits)
    # Renormalized weights sum to 1; the plain top-2 softmax probabilities sum to less.
    assert not torch.allclose(on, off)


def test_expert_parallel_rank_skips_other_experts_unread(weights):
    group = GroupCoordinator(ranks=[0, 1], rank=1)
    parallel_state.set_groups(group, GroupCoordinator(ranks=[0], rank=0))
    parallel_state.set_ep_group(group)
    layer = FusedMoE(EXPERTS, 2, HIDDEN, INTER, True, reduce_results=False)

    def unreadable(index):
        raise AssertionError("rank 1 read a tensor of an expert it does not hold")

    param = layer.w13_weight
    tensor = CheckpointTensor("experts.0.w1.weight", (INTER, HIDDEN), unreadable)
    param.weight_loader(param, tensor, "gate", 0)  # expert 0 lives on rank 0: not read


def test_expert_checkpoint_names():
    assert expert_param("model.layers.3.block_sparse_moe.experts.7.w3.weight") == (
        "model.layers.3.block_sparse_moe.experts.w13_weight",
        7,
        "up",
    )
    assert expert_param("model.layers.0.mlp.experts.12.down_proj.weight") == (
        "model.layers.0.mlp.experts.w2_weight",
        12,
        "down",
    )
    assert expert_param("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert expert_param("model.layers.0.mlp.gate.weight") is None


def test_cpu_prepacked_experts_match_the_reference(weights):
    """The engine repacks each expert for oneDNN after loading (the stacked weights freed)."""
    layers = [build_rank(weights, r, 3, True, 2, True) for r in range(3)]
    for layer in layers:
        layer.process_weights_after_loading()
    if layers[0]._packed is None:
        pytest.skip("oneDNN prepacking is not available (or LLMCTL_CPU_PREPACK=0)")
    assert layers[0].w13_weight.numel() == 0
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3))
    logits = x @ weights["router"].T
    with torch.no_grad():
        total = sum(layer(x, logits) for layer in layers)
    expected = reference(x, weights["router"], weights["w1"], weights["w3"], weights["w2"], 2, True)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
