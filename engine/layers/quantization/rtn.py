"""Round-to-nearest weight quantization of float checkpoints (`--quantization int8|int4`).

    quantize_rtn(w [N, K], bits, group_size) -> (q, scales, zeros)

in the packed-weight contract of kernels/cpu/quantized_matmul.py,
W ~= q * scales[:, k // g] + zeros[:, k // g]:
- int4: asymmetric per group: scale = (max - min) / 15, zero = min, q = round((w - min) / scale)
  in [0, 15]; |w - W| <= scale / 2.
- int8: symmetric per group: scale = max|w| / 127, q = round(w / scale) in [-127, 127], zeros
  None; |w - W| <= scale / 2.
A constant group (scale 0) gets scale 1 and reproduces its value exactly.
"""

from __future__ import annotations

import torch


def quantize_rtn(
    w: torch.Tensor, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w: [N, K] float with K a multiple of group_size -> (q, scales, zeros), scales and zeros
    float32 [N, K // group_size], q uint8 (bits=4) or int8 (bits=8). ValueError otherwise."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; use 4 or 8")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}")
    groups = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if bits == 8:
        scales = groups.abs().amax(dim=-1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(groups / scales[..., None]).clamp_(-127, 127).to(torch.int8)
        return q.reshape(n, k), scales, None
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scales, lo
