"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a slice of the
vocabulary. The embedding sums the ranks' lookups with an all-reduce; the LM head gathers the
ranks' logits so the sampler sees the whole vocabulary.

A quantized GGUF embedding (token_embd, Q8_0 in the bundled model) stays in its groups: a lookup
dequantizes only the selected rows, and an LM head reading it (tied, or its own quantized
`output` tensor) multiplies with the packed weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.distributed.parallel_state import get_tp_group
from llmctl.engine.distributed.partition import column_shards, offsets
from llmctl.engine.kernels.cpu.quantized_matmul import PackedLinearWeight
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor, QuantizedCheckpointTensor
from llmctl.engine.layers.linear import _copy_into, _cpu_prepack_enabled


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_embeddings = num_embeddings
        shards = column_shards(num_embeddings, self.tp_size, "vocabulary entries")
        self.shards = shards
        self.vocab_start = offsets(shards)[self.tp_rank]
        self.vocab_end = self.vocab_start + shards[self.tp_rank]
        self.weight = nn.Parameter(
            torch.empty(shards[self.tp_rank], embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        # A quantized checkpoint's rows, packed (None: float weights); a tied LM head shares it.
        self.packed: PackedLinearWeight | None = None
        self._dtype = torch.get_default_dtype()

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, *args) -> None:
        rows = self.vocab_end - self.vocab_start
        shard = loaded.narrow(0, self.vocab_start, rows)
        if isinstance(shard, QuantizedCheckpointTensor):
            if shard.shape == tuple(param.shape):
                self.packed = shard.decode().to(param.device)
                param.data = param.data.new_empty(0)  # the float rows are never materialised
                return
            shard = shard.load()
        _copy_into(param, shard, "vocab embedding")

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight)
        return self.packed.embedding(ids).to(self._dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._embed(input_ids)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = self._embed(local_ids)
        out.masked_fill_(~in_shard.unsqueeze(-1), 0)
        return get_tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden_states -> logits over the whole vocabulary. With tied embeddings it shares the
    embedding's parameter (and its vocabulary shard)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.vocab_end - self.vocab_start), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._packed: torch.Tensor | None = None
        self._tied_embedding: VocabParallelEmbedding | None = None

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self._tied = True
        self._tied_embedding = embedding

    def process_weights_after_loading(self) -> None:
        if self._tied_embedding is not None:
            self.packed = self._tied_embedding.packed  # one packed copy for both
        if self.packed is not None:
            return
        if _cpu_prepack_enabled(self.weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 64)
            if not getattr(self, "_tied", False):  # a tied weight still serves the embedding
                self.weight.data = self.weight.data.new_empty(0)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, hidden_size] -> logits [num_rows, vocab_size] on tp_rank 0 (the rank
        that samples); None on the other tensor-parallel ranks. In the activations' dtype: the
        sampler widens them to float32 where it computes with them, and a greedy step's argmax
        reads bfloat16 as it is (a float32 copy of 64 rows of a 49152-token vocabulary cost
        ~2.6 ms of each SmolLM2 W2 step on the CPU)."""
        if self.packed is not None:
            logits = self.packed.matmul(hidden_states)
            if self.bias is not None:
                logits = logits + self.bias
        elif self._packed is not None:
            logits = torch.ops.mkldnn._linear_pointwise(
                hidden_states, self._packed, self.bias, "none", [], ""
            )
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        if self.tp_size > 1:
            logits = get_tp_group().gather(logits, dim=-1, sizes=self.shards)
            if logits is None:
                return None
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits with compute_logits()")
