"""The Triton kernels behind triton_attention.py; shapes, masks and contracts are in its doc.

Scores are kept in log2 units (qk_scale = scale * log2(e), exp2), accumulated in float32 with an
online softmax: per query row the running max m_i, the running sum l_i of exp2(score - m_i) and
the unnormalized output acc. Masked scores are -inf; m_i starts at a finite NO_SCORE, so a row
whose keys are all masked in a tile stays at (NO_SCORE, 0, 0) and never computes inf - inf.
Pointers to K and V are built per key row (block id from the block table, then the row in the
block), with block ids widened to int64 before they meet a stride. A head's sink (gpt-oss) joins
the softmax's denominator last (`add_sink`), in the same log2 units.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The running max before any key: finite, so exp2 of a difference is never NaN.
NO_SCORE = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def add_sink(sink, m_i, l_i, acc):
    """The online softmax's state after one more term, exp(sink), in its denominator only.
    sink: [M] or one value, in natural-log units; m_i, l_i: [M]; acc: [M, D]."""
    s = sink * LOG2E
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(s - m_new), acc * alpha[:, None]


@triton.jit
def attend_tile(
    q,
    k,
    v,
    visible,
    qk_scale,
    m_i,
    l_i,
    acc,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """One online-softmax step: q [M, D], k and v [N, D], visible [M, N] -> new (m_i, l_i, acc).
    MASKED False: every score counts (`visible` is not read)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N] float32
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_kv_tile(
    key_cache_ptr,
    value_cache_ptr,
    bt_row,
    pos,
    in_range,
    offs_d,
    kv_head,
    head_dim,
    block_size,
    stride_btb,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    UPCAST: tl.constexpr,
):
    """The keys and values at positions `pos` of one KV head, through the sequence's block table
    row `bt_row`; positions outside `in_range` read as 0. Both [BLOCK_N, BLOCK_D]."""
    block = tl.load(bt_row + (pos // block_size) * stride_btb, mask=in_range, other=0)
    mask_nd = in_range[:, None] & (offs_d[None, :] < head_dim)
    row = block.to(tl.int64) * stride_kb + (pos % block_size) * stride_ko
    k = tl.load(
        key_cache_ptr + row[:, None] + kv_head * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask_nd,
        other=0.0,
    )
    row = block.to(tl.int64) * stride_vb + (pos % block_size) * stride_vo
    v = tl.load(
        value_cache_ptr + row[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask_nd,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def paged_decode_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    qk_scale,
    sliding_window,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    stride_bts,
    stride_btb,
    stride_os,
    stride_oh,
    stride_od,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]: this group's query heads, padded
    mask_gd = (offs_g[:, None] < GROUP) & (offs_d[None, :] < head_dim)
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_gd,
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [lo, hi): this partition's share of the sequence's visible keys (the window's). The
    # share is sized from this sequence's length, tile-aligned: the grid depends on shapes only
    # (a CUDA graph replays it for any lengths), the work per program on the length.
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - sliding_window, 0)
    aligned = (first // BLOCK_N) * BLOCK_N
    share = tl.cdiv(tl.cdiv(seq_len - aligned, NUM_PARTITIONS), BLOCK_N) * BLOCK_N
    lo = tl.maximum(aligned + part * share, first)
    hi = tl.minimum(seq_len, aligned + (part + 1) * share)
    m_i = tl.full([BLOCK_G], NO_SCORE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for start in range(aligned + part * share, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        in_range = (pos >= lo) & (pos < hi)
        k, v = load_kv_tile(
            key_cache_ptr,
            value_cache_ptr,
            bt_row,
            pos,
            in_range,
            offs_d,
            kv_head,
            head_dim,
            block_size,
            stride_btb,
            stride_kb,
            stride_ko,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vo,
            stride_vh,
            stride_vd,
            UPCAST,
        )  # [BLOCK_N, BLOCK_D] each
        visible = in_range[None, :]  # [1, BLOCK_N]: every query head sees the same keys
        m_i, l_i, acc = attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, DOT_PRECISION)

    if NUM_PARTITIONS == 1:
        if USE_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=offs_g < GROUP, other=0.0).to(tl.float32)
            m_i, l_i, acc = add_sink(sink, m_i, l_i, acc)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0: no keys, zeros
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:
        # part_* are contiguous [num_seqs, num_heads, NUM_PARTITIONS(, head_dim)]
        num_heads = tl.num_programs(1) * GROUP
        stat = (seq * num_heads + heads) * NUM_PARTITIONS + part  # [BLOCK_G]
        tl.store(part_max_ptr + stat, m_i, mask=offs_g < GROUP)
        tl.store(part_sum_ptr + stat, l_i, mask=offs_g < GROUP)
        tl.store(part_out_ptr + stat[:, None] * head_dim + offs_d[None, :], acc, mask=mask_gd)


@triton.jit
def merge_partitions_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_out_ptr,
    sinks_ptr,
    stride_os,
    stride_oh,
    stride_od,
    head_dim,
    NUM_PARTITIONS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """out[seq, head] = sum_p exp(m_p - M) acc_p / (sum_p exp(m_p - M) l_p + exp(sink - M))."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_p = offs_p < NUM_PARTITIONS
    stat = (seq * tl.num_programs(1) + head) * NUM_PARTITIONS + offs_p  # [BLOCK_P]
    m = tl.load(part_max_ptr + stat, mask=mask_p, other=NO_SCORE)
    l_p = tl.load(part_sum_ptr + stat, mask=mask_p, other=0.0)
    mask_pd = mask_p[:, None] & (offs_d[None, :] < head_dim)
    acc = tl.load(
        part_out_ptr + stat[:, None] * head_dim + offs_d[None, :], mask=mask_pd, other=0.0
    )
    top = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # [BLOCK_P]; scores are already in log2 units
    total = tl.sum(l_p * weight, 0)
    if USE_SINKS:
        total += tl.exp2(sink - top)
    o = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    dst = out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@triton.jit
def load_kv_tile_unmasked(
    key_cache_ptr,
    value_cache_ptr,
    bt_row,
    pos,
    offs_d,
    kv_head,
    head_dim,
    block_size,
    stride_btb,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    PAD_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """load_kv_tile for a tile whose positions are all the sequence's: no mask but head_dim's
    padding (PAD_D), so the loads are plain vector loads."""
    block = tl.load(bt_row + (pos // block_size) * stride_btb)
    row_k = block.to(tl.int64) * stride_kb + (pos % block_size) * stride_ko
    row_v = block.to(tl.int64) * stride_vb + (pos % block_size) * stride_vo
    k_ptrs = key_cache_ptr + row_k[:, None] + kv_head * stride_kh + offs_d[None, :] * stride_kd
    v_ptrs = value_cache_ptr + row_v[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd
    if PAD_D:
        mask_d = offs_d[None, :] < head_dim
        k = tl.load(k_ptrs, mask=mask_d, other=0.0)
        v = tl.load(v_ptrs, mask=mask_d, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def find_chunk(query_start_loc_ptr, num_chunks, program, BLOCK_Q: tl.constexpr):
    """The chunk whose query blocks hold `program`: chunk c's blocks start at program
    query_start_loc[c] // BLOCK_Q + c (it has at most query_len // BLOCK_Q + 1 of them), so the
    last c whose start is <= program (a binary search over the num_chunks + 1 offsets)."""
    lo = 0
    hi = num_chunks
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        before = start <= program
        lo = tl.where(before, mid + 1, lo)
        hi = tl.where(before, hi, mid)
    return lo - 1


@triton.jit
def varlen_attention_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    context_lens_ptr,
    sinks_ptr,
    qk_scale,
    sliding_window,
    num_chunks,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    stride_btc,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_od,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAD_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Causal attention of packed query chunks (prefill chunks, or one-token decodes) over the
    paged cache. Program (i, kv_head) takes BLOCK_Q queries of one chunk and the GROUP query
    heads that share kv_head: BLOCK_M = BLOCK_Q * GROUP_PAD rows (row r: query r // GROUP_PAD,
    head r % GROUP_PAD), so each K and V tile is read once for the whole group. Key tiles that
    every query of the block sees are attended without masks (nor masked loads); only the tiles
    on the causal diagonal (and, with a window, all of them) are masked."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = find_chunk(query_start_loc_ptr, num_chunks, program, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + chunk).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + chunk + 1).to(tl.int32) - query_start
    q_block = program - (query_start // BLOCK_Q + chunk)
    if q_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + chunk).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + chunk).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] query index within the chunk
    in_group = rows % GROUP_PAD
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    valid = (q_tok < query_len) & (in_group < GROUP)
    mask_md = valid[:, None] & (offs_d[None, :] < head_dim)
    tokens = (query_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr
        + tokens[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=mask_md,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_tok  # [BLOCK_M] positions in the sequence

    # Keys [lo, hi): up to the block's last query; [lo, interior) is seen by every query.
    first_q = context_len + q_block * BLOCK_Q
    hi = tl.minimum(seq_len, first_q + BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, first_q - sliding_window + 1)
    start = (lo // BLOCK_N) * BLOCK_N
    interior = start
    if not USE_WINDOW:
        interior = ((first_q + 1) // BLOCK_N) * BLOCK_N  # tiles wholly at or before first_q
    m_i = tl.full([BLOCK_M], NO_SCORE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + chunk.to(tl.int64) * stride_btc
    for tile in range(start, interior, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile_unmasked(
            key_cache_ptr, value_cache_ptr, bt_row, pos, offs_d, kv_head, head_dim, block_size,
            stride_btb, stride_kb, stride_ko, stride_kh, stride_kd,
            stride_vb, stride_vo, stride_vh, stride_vd, PAD_D, UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = attend_tile(q, k, v, None, qk_scale, m_i, l_i, acc, DOT_PRECISION, False)
    for tile in range(interior, hi, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        in_range = (pos >= lo) & (pos < hi)
        k, v = load_kv_tile(
            key_cache_ptr, value_cache_ptr, bt_row, pos, in_range, offs_d, kv_head, head_dim,
            block_size, stride_btb, stride_kb, stride_ko, stride_kh, stride_kd,
            stride_vb, stride_vo, stride_vh, stride_vd, UPCAST,
        )  # fmt: skip
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        m_i, l_i, acc = attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, DOT_PRECISION)

    if USE_SINKS:  # each row's own head's sink
        sink = tl.load(sinks_ptr + heads, mask=in_group < GROUP, other=0.0).to(tl.float32)
        m_i, l_i, acc = add_sink(sink, m_i, l_i, acc)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = (
        out_ptr
        + tokens[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :] * stride_od
    )
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_md)
