"""PackedMoEMethod (vLLM's FusedMoE `quant_method`): a mixture of experts kept packed.

A FusedMoE built under a QuantizationConfig holds no stacked float tensors: a GGUF file's
experts keep their blocks; a float checkpoint's, under --quantization int8/int4, are quantized
round-to-nearest (per group along the input features) as each rank reads its slice. Each expert
this rank holds keeps, packed as the dense layers' weights (quantized_matmul.PackedLinearWeight):
- w13[e]: its gate rows then its up rows, [2 * I_local, H] (this rank's feature slice under
  tensor parallelism; the whole expert under expert parallelism), one packed weight, or one per
  format when gate and up differ (a Q4_K_M file mixes Q4_K and Q6_K);
- w2[e]: its down matrix [H, I_local], the columns of this rank's features (whole blocks).
Only the experts and the rows / blocks this rank holds are read from the file. An expert's
matmul is `ExpertWeight.matmul(x)`: the C++ kernel on its tokens' rows [n, K] (the decode
kernel up to quantized_matmul.SMALL_BATCH rows, tiles of dequantized weights beyond), float32
inside.
An expert matrix stored in float (F16/F32) stays float and is multiplied by F.linear.
"""

from __future__ import annotations

import torch

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.quantization.linear_method import decode_piece, pack_pieces
from llmctl.engine.layers.quantization.quant_config import QuantizationConfig

_ROLE_ORDER = ("gate", "up")  # w13's rows: gate, then up (as the float layer stacks them)


class ExpertWeight:
    """One expert matrix: packed parts (or float rows) concatenated along the output."""

    def __init__(self, parts: list):
        self.parts = parts

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x [n, K] -> [n, N]
        if len(self.parts) == 1:
            return self.parts[0].matmul(x)
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def expert_matmul(x: torch.Tensor, weight: ExpertWeight) -> torch.Tensor:
    """fused_moe.fused_experts' `linear` for packed experts: x [n, K] @ weight^T -> [n, N]."""
    return weight.matmul(x)


class PackedMoEMethod:
    def __init__(self, config: QuantizationConfig, num_local_experts: int):
        self.config = config
        self.num_local_experts = num_local_experts
        self._gate_up: list[dict[str, tuple]] = [{} for _ in range(num_local_experts)]
        self.w13: list[ExpertWeight | None] = [None] * num_local_experts
        self.w2: list[ExpertWeight | None] = [None] * num_local_experts

    def store(
        self,
        local: int,
        shard_id: str,
        loaded,
        expected: tuple[int, int],
        device: torch.device,
        what: str,
    ) -> None:
        """Take local expert `local`'s slice of one matrix (gate, up: [I_local, H]; down:
        [H, I_local], as the weight loader narrowed it), decoding its blocks now: one expert's
        matrices at a time are unpacked in memory."""
        shape = tuple(loaded.shape)
        if shape != expected:
            raise ModelLoadError(
                f"{what}: checkpoint shard has shape {shape}, the model expects {expected}",
                "the weights do not match config.json; check that both come from the same model",
            )
        piece = decode_piece(self.config, loaded)
        if shard_id == "down":
            self.w2[local] = ExpertWeight(pack_pieces([piece], device))
            return
        pieces = self._gate_up[local]
        pieces[shard_id] = piece
        if len(pieces) == len(_ROLE_ORDER):  # both halves: pack (and concatenate) them
            self.w13[local] = ExpertWeight(pack_pieces([pieces[r] for r in _ROLE_ORDER], device))
            pieces.clear()

    def check_loaded(self, first_expert: int, what: str) -> None:
        """Raise ModelLoadError naming an expert whose matrices the checkpoint did not give."""
        for local in range(self.num_local_experts):
            if self.w13[local] is None or self.w2[local] is None:
                raise ModelLoadError(
                    f"{what}: the checkpoint gave no complete weights for expert "
                    f"{first_expert + local} (gate, up and down)",
                    "the weight files are incomplete or belong to another model",
                )

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (*self.w13, *self.w2) if w is not None)
