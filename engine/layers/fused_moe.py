"""FusedMoE: the routed experts of a mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

Every expert is a SiLU-gated MLP. The layer holds them stacked, as one tensor per role:
`w13_weight` [num_local_experts, 2 * I, H] ([gate | up] rows, like MergedColumnParallelLinear)
and `w2_weight` [num_local_experts, H, I] (down). A forward routes each token to its top-k
experts (softmax over the router logits, then top-k, renormalized or not as the model's config
says), groups the tokens by expert, runs one gate_up matmul, SiLU-and-mul and down matmul per
expert that received tokens, and adds the outputs back weighted by the routing probabilities.

How the ranks of the tensor-parallel group share the experts:
- tensor parallel (the default): every rank holds every expert, a slice of its I features
  (gate and up split by rows, down by columns, as the dense MLP's column- and row-parallel
  layers). Each rank's output is a partial sum over its features.
- expert parallel (`--enable-expert-parallel`, parallel_state.get_ep_group()): each rank holds
  whole experts, dealt out contiguously (8 experts on 3 ranks: 0-2, 3-5, 6-7). Tokens are
  replicated across the group, so dispatch is local: each rank computes its own experts'
  contribution for every token routed to them, a partial sum over the experts.
- expert parallel across data-parallel replicas (`--enable-expert-parallel` with
  `--data-parallel-size N`, engine/dp/lockstep.py): the EP group is every rank of the N
  replicas (EP size = DP x TP), and each replica runs its own tokens. Dispatch: an all-gather
  over the DP group (this rank and the ranks with the same tp_rank in the other replicas) of
  every replica's hidden states and router logits, padded to the largest count; each rank
  computes its experts for every replica's tokens. Combine: an all-reduce over the DP group,
  of which each rank keeps its own replica's rows. A replica's TP ranks hold its tokens alike
  and different experts, so each gathers over its own DP group and their sums are disjoint:
  the TP all-reduce below then completes the sum over all DP x TP ranks exactly.
Either way the partial sums are combined with one all-reduce over the (tensor-parallel) group,
as the MLP's row-parallel layer does (`reduce_results=False` leaves it to the caller, e.g. to
add Qwen2-MoE's shared expert first).

Built under a QuantizationConfig (a quantized GGUF file, or --quantization int8/int4 on a float
checkpoint), the layer's `quant_method` is a quantization/moe_method.PackedMoEMethod: the same
split, each expert's slices kept in their GGUF blocks (or quantized round-to-nearest as they are
read) and multiplied by the quantized matmul kernel; the stacked float tensors stay empty.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.distributed.parallel_state import get_dp_group, get_ep_group, get_tp_group
from llmctl.engine.distributed.partition import column_shards, expert_shards, offsets
from llmctl.engine.forward_context import num_tokens_across_dp
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.linear import _copy_into, _cpu_prepack_enabled
from llmctl.engine.layers.quantization.linear_method import current_quant_config
from llmctl.engine.layers.quantization.moe_method import PackedMoEMethod, expert_matmul

# Checkpoint roles of an expert's matrices -> (fused parameter, shard id).
_ROLES = {
    "w1": ("w13_weight", "gate"),  # Mixtral
    "w3": ("w13_weight", "up"),
    "w2": ("w2_weight", "down"),
    "gate_proj": ("w13_weight", "gate"),  # Qwen MoE
    "up_proj": ("w13_weight", "up"),
    "down_proj": ("w2_weight", "down"),
}
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def expert_param(name: str) -> tuple[str, int, str] | None:
    """ "model.layers.0.mlp.experts.3.w1.weight" -> ("model.layers.0.mlp.experts.w13_weight", 3,
    "gate"): the stacked parameter, the expert and its shard id; None for any other tensor."""
    match = _EXPERT_NAME.match(name)
    if match is None or match.group(3) not in _ROLES:
        return None
    param, shard_id = _ROLES[match.group(3)]
    return f"{match.group(1)}.{param}", int(match.group(2)), shard_id


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (weights [num_tokens, top_k] in float32,
    expert ids [num_tokens, top_k]): softmax, then top-k, then (renormalize) divided by their
    sum, as Hugging Face's routers compute it."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor | Sequence[torch.Tensor],
    w2: torch.Tensor | Sequence[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """sum over each token's top-k experts e held here of weight * down(silu(gate) * up)(x).

    hidden_states [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I] (or per-expert lists of
    weights `linear` multiplies by, e.g. oneDNN-packed); topk_* [T, k] with global expert ids,
    of which [first_expert, first_expert + E_local) are held here. Returns [T, H].

    The (token, slot) pairs are sorted by expert, so each expert's tokens are one contiguous run
    of a single gather; the outputs come back through the inverse permutation (another gather)
    and each token's k slots are added in ascending expert order, the order Hugging Face's
    per-expert index_add_ adds them. No scatter: on the CPU, index_add_ runs a parallel region
    per call (0.3 ms for one [1, 512] row on 2 threads of a busy machine, 5 us on one), which
    made a single decode stream 2x slower than transformers.
    """
    num_tokens, top_k = topk_ids.shape
    num_local = len(w13)
    # Slots sorted by expert within each token: the sum below then adds in expert order.
    topk_ids, slot_order = torch.sort(topk_ids, dim=-1)
    topk_weights = topk_weights.gather(-1, slot_order)
    flat_ids = topk_ids.reshape(-1) - first_expert  # [T * k], local ids (others out of range)
    held = (flat_ids >= 0) & (flat_ids < num_local)
    # Expert num_local collects the pairs another rank holds: sorted last, never computed.
    keys = torch.where(held, flat_ids, num_local)
    order = torch.argsort(keys, stable=True)  # [T * k] pair indices, grouped by expert
    counts = torch.bincount(keys, minlength=num_local + 1).tolist()
    num_held = len(keys) - counts[num_local]
    x = hidden_states[order[:num_held] // top_k]  # [num_held, H], expert by expert
    ys, start = [], 0
    for expert, count in enumerate(counts[:num_local]):
        if count == 0:
            continue
        gate_up = linear(x[start : start + count], w13[expert])  # [n, 2I]
        start += count
        inter = gate_up.shape[-1] // 2
        ys.append(linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[expert]))  # [n, H]
    # [num_held + 1, H]: the outputs in sorted order, then a zero row for the pairs not held
    ys.append(hidden_states.new_zeros(1, hidden_states.shape[-1]))
    y = torch.cat(ys)
    weights = torch.cat([topk_weights.reshape(-1)[order[:num_held]], topk_weights.new_zeros(1)])
    y.mul_(weights[:, None])  # computed in float32, rounded once to the dtype (as HF)
    # inverse[pair] = its row of y (pairs not held: the zero row)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device).clamp_(max=num_held)
    y = y[inverse].view(num_tokens, top_k, -1)  # [T, k, H]
    out = y[:, 0]
    for slot in range(1, top_k):
        out = out + y[:, slot]
    return out


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: forward(hidden_states, router_logits)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        reduce_results: bool = True,
    ):
        super().__init__()
        tp, ep = get_tp_group(), get_ep_group()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.reduce_results = reduce_results
        # Across data-parallel replicas: tokens are exchanged over the DP group, the partial
        # sums reduced over the TP group.
        self.dp_group = get_dp_group() if ep is not None else None
        if ep is not None:  # whole experts per rank
            self.group = ep if self.dp_group is None else tp
            sizes = expert_shards(num_experts, ep.world_size)
            self.first_expert = offsets(sizes)[ep.rank_in_group]
            self.num_local_experts = sizes[ep.rank_in_group]
            self.intermediate_start, self.intermediate_size_per_partition = 0, intermediate_size
        else:  # a slice of every expert's features per rank
            self.group = tp
            shards = column_shards(intermediate_size, tp.world_size, "expert MLP features")
            self.first_expert, self.num_local_experts = 0, num_experts
            self.intermediate_start = offsets(shards)[tp.rank_in_group]
            self.intermediate_size_per_partition = shards[tp.rank_in_group]
        inter = self.intermediate_size_per_partition
        self.hidden_size = hidden_size
        quant = current_quant_config()
        self.quant_method: PackedMoEMethod | None = None
        if quant is not None:
            self.quant_method = PackedMoEMethod(quant, self.num_local_experts)
            # placeholders that carry the weight loader; the packed experts are not parameters
            self.w13_weight = nn.Parameter(torch.empty(0), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(0), requires_grad=False)
        else:
            self.w13_weight = nn.Parameter(
                torch.empty(self.num_local_experts, 2 * inter, hidden_size), requires_grad=False
            )
            self.w2_weight = nn.Parameter(
                torch.empty(self.num_local_experts, hidden_size, inter), requires_grad=False
            )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self._packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str, expert_id: int
    ) -> None:
        """Put expert `expert_id`'s checkpoint matrix (gate, up: [I, H]; down: [H, I]) into this
        rank's stacked tensor; an expert another rank holds is skipped unread."""
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        start, size = self.intermediate_start, self.intermediate_size_per_partition
        if self.quant_method is not None:
            if shard_id == "down":
                rows, expected = loaded.narrow(1, start, size), (self.hidden_size, size)
            else:
                rows, expected = loaded.narrow(0, start, size), (size, self.hidden_size)
            what = f"expert {expert_id} {shard_id}"
            device = param.device  # the placeholder was made on the model's device
            self.quant_method.store(local, shard_id, rows, expected, device, what)
            return
        if shard_id == "down":
            rows, dest = loaded.narrow(1, start, size), param.data[local]
        else:
            rows = loaded.narrow(0, start, size)
            dest = param.data[local].narrow(0, 0 if shard_id == "gate" else size, size)
        if not isinstance(rows, torch.Tensor):
            rows = rows.load()
        _copy_into(dest, rows, f"expert {expert_id} {shard_id}")

    def process_weights_after_loading(self) -> None:
        """On the CPU, each expert's matrices repacked for oneDNN (as the linear layers': about
        1.5x faster per expert matmul); the packed copies replace the stacked weights.
        Quantized experts: a ModelLoadError if the checkpoint left one incomplete."""
        if self.quant_method is not None:
            self.quant_method.check_loaded(self.first_expert, type(self).__name__)
            return
        if not _cpu_prepack_enabled(self.w13_weight):
            return
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self._packed = (
            [reorder(w, 64) for w in self.w13_weight.data],
            [reorder(w, 64) for w in self.w2_weight.data],
        )
        self.w13_weight.data = self.w13_weight.data.new_empty(0)
        self.w2_weight.data = self.w2_weight.data.new_empty(0)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # hidden_states [num_tokens, hidden_size]; router_logits [num_tokens, num_experts]
        if self.dp_group is not None:
            out = self._forward_across_dp(hidden_states, router_logits)
        else:
            out = self._experts(hidden_states, router_logits)
        if self.reduce_results:
            out = self.group.all_reduce(out)
        return out

    def _experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's experts' partial sum for every token: [num_tokens, hidden_size]."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        w13, w2, linear = self.w13_weight, self.w2_weight, F.linear
        if self.quant_method is not None:
            w13, w2, linear = self.quant_method.w13, self.quant_method.w2, expert_matmul
        elif self._packed is not None:
            (w13, w2), linear = self._packed, _packed_linear
        return fused_experts(
            hidden_states, w13, w2, topk_weights, topk_ids, self.first_expert, linear
        )

    def _forward_across_dp(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch every replica's tokens to this rank's experts and combine the partial sums
        of this replica's tokens (the module docstring says how)."""
        dp = self.dp_group
        num_tokens, hidden = hidden_states.shape
        sizes = num_tokens_across_dp(num_tokens, dp, hidden_states.device)
        largest = max(sizes)
        # [largest, hidden_size + num_experts]: one all-gather for both
        both = torch.cat([hidden_states, router_logits.to(hidden_states.dtype)], dim=1)
        if num_tokens < largest:
            both = torch.cat([both, both.new_zeros(largest - num_tokens, both.shape[1])])
        gathered = dp.all_gather(both)  # [dp_size * largest, hidden_size + num_experts]
        if any(size != largest for size in sizes):  # the padding rows go: no expert runs them
            rows = torch.cat(
                [torch.arange(r * largest, r * largest + n) for r, n in enumerate(sizes)]
            ).to(gathered.device)
            gathered = gathered.index_select(0, rows)
        # [sum(sizes), hidden_size], every replica's tokens in DP rank order
        out = self._experts(gathered[:, :hidden], gathered[:, hidden:])
        out = dp.all_reduce(out.contiguous())
        start = sum(sizes[: dp.rank_in_group])
        return out[start : start + num_tokens]

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return (
            f"experts {self.first_expert}-{last} of {self.num_experts}, top_k={self.top_k}, "
            f"intermediate {self.intermediate_size_per_partition} per rank"
        )
