"""Multi-head latent attention on the GPU: the latent cache write and the absorbed decode (Triton).

The cache of one layer: [num_blocks, block_size, kv_lora_rank + rope] (unit last stride), per
token its latent then its rope key (attention/mla_layer.py).

    mla_write_cache(latent, k_pe, cache, slot_mapping)

latent [num_tokens, kv_lora_rank], k_pe [num_tokens, rope] (unit last strides): token i's row goes
to slot slot_mapping[i] (block slot // block_size, row slot % block_size); a negative slot skips
the token (a CUDA-graph batch's padding). One program per token.

    mla_decode_attention(q_latent, q_pe, cache, block_tables, seq_lens, scale) -> [B, H, L]

One query token per sequence, every head attending the same cached rows (multi-query attention
with two-part keys): score(h, t) = q_latent[h] . latent[t] + q_pe[h] . k_pe[t], values the
latents. q_latent [B, H, L = kv_lora_rank] (the query already folded through W_UK), q_pe
[B, H, rope]; block_tables [B, max_blocks], seq_lens [B] (the query's own token included; 0: a
padding row, zeros out). One program per (sequence, BLOCK_H heads, key partition) holds its heads'
queries as the rows of tl.dot (padded to 16), so each cached row is read once per head block, and
walks its keys BLOCK_N at a time with an online softmax in float32 (log2 units, as
triton_attention_kernels). The latent and rope parts stay separate powers of two (512 and 64 for
DeepSeek-V3: no padding of 576 to 1024). When fewer than 128 (sequence, head block) programs
would run and the block table spans more than 512 keys, the keys are split into up to 64
partitions (flash-decoding) whose (max, sum, unnormalized output) merge_partitions_kernel adds
up; the split depends only on shapes, never on seq_lens, so a captured CUDA graph stays valid.
Float32 dots are IEEE (no TF32). On CPU tensors the kernels run under Triton's interpreter
(TRITON_INTERPRET=1), bfloat16 tiles widened to float32 there (its tl.dot multiplies raw bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmctl.engine.kernels.triton.triton_attention_kernels import (
    NO_SCORE,
    merge_partitions_kernel,
)

_LOG2E = 1.4426950408889634
_PARTITION_SIZE = 512
_FEW_PROGRAMS = 128
_MAX_PARTITIONS = 64
_BLOCK_H = 16  # query heads per program: tl.dot's smallest M


def mla_write_cache(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, kv_lora_rank = latent.shape
    if num_tokens == 0:
        return
    rope = k_pe.shape[1]
    _write_kernel[(num_tokens,)](
        latent,
        k_pe,
        cache,
        slot_mapping,
        latent.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        cache.stride(1),
        kv_lora_rank,
        rope,
        cache.shape[1],
        BLOCK_L=triton.next_power_of_2(kv_lora_rank),
        BLOCK_R=triton.next_power_of_2(rope),
    )


@triton.jit
def _write_kernel(
    latent_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr,
    stride_lt, stride_rt, stride_cb, stride_co,
    kv_lora_rank, rope, block_size,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    row = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_co
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(latent_ptr + token * stride_lt + offs_l, mask=offs_l < kv_lora_rank)
    tl.store(row + offs_l, c.to(cache_ptr.dtype.element_ty), mask=offs_l < kv_lora_rank)
    r = tl.load(k_pe_ptr + token * stride_rt + offs_r, mask=offs_r < rope)
    tl.store(row + kv_lora_rank + offs_r, r.to(cache_ptr.dtype.element_ty), mask=offs_r < rope)


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode; see the module doc. Returns [B, H, kv_lora_rank] in q's dtype."""
    num_seqs, num_heads, kv_lora_rank = q_latent.shape
    rope = q_pe.shape[-1]
    if cache.shape[-1] != kv_lora_rank + rope or q_latent.dtype != cache.dtype:
        raise ValueError(
            f"MLA decode: a cache of [..., {cache.shape[-1]}] {cache.dtype} for queries of "
            f"{kv_lora_rank} + {rope} features in {q_latent.dtype}"
        )
    out = torch.empty_like(q_latent)
    if num_seqs == 0:
        return out
    block_l, block_r = triton.next_power_of_2(kv_lora_rank), triton.next_power_of_2(rope)
    block_n = 16 if block_l >= 256 else 32
    head_blocks = triton.cdiv(num_heads, _BLOCK_H)
    max_keys = block_tables.shape[1] * cache.shape[1]
    num_partitions = 1
    if num_seqs * head_blocks < _FEW_PROGRAMS:
        num_partitions = min(triton.cdiv(max_keys, _PARTITION_SIZE), _MAX_PARTITIONS)
    partition_size = triton.cdiv(triton.cdiv(max_keys, num_partitions), block_n) * block_n
    if num_partitions > 1:
        part_max = torch.empty((num_seqs, num_heads, num_partitions), device=q_latent.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty((*part_max.shape, kv_lora_rank), device=q_latent.device)
    else:
        part_max = part_sum = part_out = out  # unused: the kernel writes out directly
    upcast = q_latent.device.type == "cpu" and q_latent.dtype == torch.bfloat16
    _decode_kernel[(num_seqs, head_blocks, num_partitions)](
        out, part_max, part_sum, part_out, q_latent, q_pe, cache, block_tables, seq_lens,
        scale * _LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1),
        *block_tables.stride(),
        out.stride(0), out.stride(1),
        num_heads, kv_lora_rank, rope, cache.shape[1], partition_size,
        BLOCK_H=_BLOCK_H, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_N=block_n,
        NUM_PARTITIONS=num_partitions, UPCAST=upcast,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        num_warps=8 if block_l >= 256 else 4,
    )  # fmt: skip
    if num_partitions > 1:
        merge_partitions_kernel[(num_seqs, num_heads)](
            out,
            part_max,
            part_sum,
            part_out,
            part_out,  # no sinks (an unread pointer)
            *out.stride(),
            kv_lora_rank,
            NUM_PARTITIONS=num_partitions,
            BLOCK_P=triton.next_power_of_2(num_partitions),
            BLOCK_D=block_l,
            USE_SINKS=False,
        )
    return out


@triton.jit
def _decode_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_out_ptr,
    ql_ptr, qr_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale,
    stride_qls, stride_qlh, stride_qrs, stride_qrh,
    stride_cb, stride_co,
    stride_bts, stride_btb,
    stride_os, stride_oh,
    num_heads, kv_lora_rank, rope, block_size, partition_size,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    part = tl.program_id(2)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_ok = heads < num_heads
    l_ok = offs_l < kv_lora_rank
    r_ok = offs_r < rope
    ql = tl.load(
        ql_ptr + seq * stride_qls + heads[:, None] * stride_qlh + offs_l[None, :],
        mask=h_ok[:, None] & l_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_L]
    qr = tl.load(
        qr_ptr + seq * stride_qrs + heads[:, None] * stride_qrh + offs_r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    if UPCAST:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    lo = part * partition_size
    hi = tl.minimum(seq_len, lo + partition_size)
    m_i = tl.full([BLOCK_H], NO_SCORE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        in_range = pos < hi
        block = tl.load(bt_row + (pos // block_size) * stride_btb, mask=in_range, other=0)
        row = block.to(tl.int64) * stride_cb + (pos % block_size) * stride_co  # [BLOCK_N]
        c = tl.load(
            cache_ptr + row[:, None] + offs_l[None, :],
            mask=in_range[:, None] & l_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_L]: the latents, also the values
        kr = tl.load(
            cache_ptr + row[:, None] + kv_lora_rank + offs_r[None, :],
            mask=in_range[:, None] & r_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_R]
        if UPCAST:
            c = c.to(tl.float32)
            kr = kr.to(tl.float32)
        qk = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        qk += tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION)
        qk = tl.where(in_range[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    mask_hl = h_ok[:, None] & l_ok[None, :]
    if NUM_PARTITIONS == 1:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0: no keys, zeros
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_l[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_hl)
    else:
        # part_* are contiguous [num_seqs, num_heads, NUM_PARTITIONS(, kv_lora_rank)]
        stat = (seq * num_heads + heads) * NUM_PARTITIONS + part  # [BLOCK_H]
        tl.store(part_max_ptr + stat, m_i, mask=h_ok)
        tl.store(part_sum_ptr + stat, l_i, mask=h_ok)
        tl.store(part_out_ptr + stat[:, None] * kv_lora_rank + offs_l[None, :], acc, mask=mask_hl)
