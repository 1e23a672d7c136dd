"""Megatron-LM linear layers. Each owns a `weight_loader` that narrows the full checkpoint tensor
to this rank's shard, so model files read like plain Hugging Face code.

Column-parallel layers split the output features (no communication); row-parallel layers split the
input features and all-reduce their partial sums: the only communication in the MLP and attention.
Shard sizes may be uneven (see distributed/partition.py).

On the CPU, weights are repacked for oneDNN after loading: its blocked layout runs the skinny
matmuls of decoding about 1.5-2x faster than the plain row-major weight.

Under a QuantizationConfig (quantization/linear_method.py) a layer's `quant_method` holds its
weights packed instead: the weight loaders narrow the checkpoint tensor the same way and hand the
rows to it (`_store`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine import envs
from llmctl.engine.distributed.parallel_state import get_tp_group
from llmctl.engine.distributed.partition import HeadShard, column_shards, head_shards, offsets
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.quantization.linear_method import (
    PackedLinearMethod,
    current_quant_config,
)


def _cpu_prepack_enabled(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and envs.LLMCTL_CPU_PREPACK
    )


def _copy_into(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        from llmctl.engine.errors import ModelLoadError

        raise ModelLoadError(
            f"{what}: checkpoint shard has shape {tuple(loaded.shape)}, the model expects "
            f"{tuple(param.shape)}",
            "the weights do not match config.json; check that both come from the same model",
        )
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size_per_partition, input_size_per_partition]."""

    def __init__(self, input_size_per_partition: int, output_size_per_partition: int, bias: bool):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        quant = current_quant_config()
        self.quant_method = PackedLinearMethod(quant) if quant is not None else None
        if self.quant_method is not None:
            self.weight = self.quant_method.create_weights(self)
        else:
            self.weight = nn.Parameter(
                torch.empty(output_size_per_partition, input_size_per_partition),
                requires_grad=False,
            )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size_per_partition), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._packed: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *args) -> None:
        self._store(param, 0, loaded, type(self).__name__, whole=True)

    def _store(self, param, row_start: int, rows, what: str, whole: bool = False) -> None:
        """Put checkpoint rows (a narrowed tensor) at rows [row_start, ...) of `param`."""
        if self.quant_method is not None and param is self.weight:
            self.quant_method.store(self, row_start, rows, what)
            return
        if not isinstance(rows, torch.Tensor):
            rows = rows.load()
        dest = param.data if whole else param.data.narrow(0, row_start, rows.shape[0])
        _copy_into(dest, rows, what)

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)
            return
        if _cpu_prepack_enabled(self.weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 64)
            # The packed copy replaces the plain weight: keep one copy in memory.
            self.weight.data = self.weight.data.new_empty(0)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = True):
        super().__init__(input_size, output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Splits the output features; `output_shards` (per-rank sizes) defaults to an even split."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        output_shards: list[int] | None = None,
    ):
        tp = get_tp_group()
        self.output_shards = output_shards or column_shards(
            output_size, tp.world_size, "output features"
        )
        super().__init__(input_size, self.output_shards[tp.rank_in_group], bias)
        self.output_size = output_size

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *args) -> None:
        start = offsets(self.output_shards)[self.tp_rank]
        rows = loaded.narrow(0, start, self.output_size_per_partition)
        self._store(param, 0, rows, "column", whole=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices stacked in one matmul, e.g. gate_proj and up_proj.

    The checkpoint stores each separately; `weight_loader(param, w, shard_id)` places this rank's
    slice of sub-matrix `shard_id` at its offset.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp = get_tp_group()
        self.shards = [column_shards(size, tp.world_size, "MLP features") for size in output_sizes]
        per_rank = [s[tp.rank_in_group] for s in self.shards]
        super().__init__(input_size, sum(per_rank), bias)
        self.output_sizes_per_partition = per_rank

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int) -> None:
        size = self.output_sizes_per_partition[shard_id]
        start = offsets(self.shards[shard_id])[self.tp_rank]
        dest_start = sum(self.output_sizes_per_partition[:shard_id])
        rows = loaded.narrow(0, start, size)
        self._store(param, dest_start, rows, f"merged column shard {shard_id}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class QKVParallelLinear(LinearBase):
    """Query, key and value projections in one matmul, split by attention heads.

    Each rank holds the heads of its HeadShard (uneven when tp does not divide the heads); KV heads
    are replicated when tp exceeds them. The output is [q | k | v] for this rank's heads.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ):
        tp = get_tp_group()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.shard: HeadShard = head_shards(total_num_heads, total_num_kv_heads, tp.world_size)[
            tp.rank_in_group
        ]
        self.num_heads = self.shard.num_q_heads
        self.num_kv_heads = self.shard.num_kv_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str) -> None:
        if shard_id == "qkv":  # a fused checkpoint tensor (GPT-2's c_attn): [q | k | v] rows
            q_rows = self.total_num_heads * self.head_size
            kv_rows = self.total_num_kv_heads * self.head_size
            for sid, start, rows in (("q", 0, q_rows), ("k", q_rows, kv_rows)):
                self.weight_loader(param, _RowSlice(loaded, start, rows), sid)
            self.weight_loader(param, _RowSlice(loaded, q_rows + kv_rows, kv_rows), "v")
            return
        if shard_id == "q":
            dest_start, size, src_start = 0, self.q_size, self.shard.q_start * self.head_size
        else:
            dest_start = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, src_start = self.kv_size, self.shard.kv_start * self.head_size
        self._store(param, dest_start, loaded.narrow(0, src_start, size), f"qkv shard {shard_id}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(LinearBase):
    """Splits the input features; partial products are summed with one all-reduce.

    `input_shards` must match the column-parallel layer that feeds it (its per-rank outputs).
    The bias is added once, after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_shards: list[int] | None = None,
        reduce_results: bool = True,
    ):
        tp = get_tp_group()
        self.input_shards = input_shards or column_shards(
            input_size, tp.world_size, "input features"
        )
        super().__init__(self.input_shards[tp.rank_in_group], output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *args) -> None:
        if param is self.bias:
            _copy_into(param, loaded.load(), "row bias")
            return
        start = offsets(self.input_shards)[self.tp_rank]
        rows = loaded.narrow(1, start, self.input_size_per_partition)
        self._store(param, 0, rows, "row", whole=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        out = self.matmul(x, None)
        if self.reduce_results:
            out = get_tp_group().all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


class _RowSlice:
    """Rows [start, start+rows) of a checkpoint tensor, narrowed lazily."""

    def __init__(self, tensor: CheckpointTensor, start: int, rows: int):
        self.tensor, self.start, self.rows = tensor, start, rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.tensor.shape[1:])

    def narrow(self, dim: int, start: int, length: int):
        if dim != 0:
            return self.tensor.narrow(0, self.start, self.rows).narrow(dim, start, length)
        return self.tensor.narrow(0, self.start + start, length)

    def load(self):
        return self.tensor.narrow(0, self.start, self.rows)
