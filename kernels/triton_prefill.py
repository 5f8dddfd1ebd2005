"""Triton paged prefill attention: variable-length query chunks over each sequence's cached prefix.

Grid: (query tile, query head). Tiles are numbered so that sequence s's tiles start at
query_start_loc[s] // BLOCK_Q + s; the total (num_tokens // BLOCK_Q + num_seqs) is known from
shapes alone, so no device value is read on the host. Each program finds its sequence by binary
search over query_start_loc (vLLM's unified attention does the same) and exits if the tile is past
its chunk. Query row r of a chunk of length n sits at absolute position seq_len - n + r and sees
keys 0..that position; keys past the tile's last row are never loaded. 8-bit caches as in
triton_decode.py: codes as dot operands, scales on the score and probability columns.
"""

import torch
import triton
import triton.language as tl
from tokenmill.kernels.triton_common import (
    NEG_INF,
    check_head_dim,
    interp_bf16,
    kv_cache_args,
    kv_column_scales,
    kv_operand,
    last_dim_contiguous,
    mma,
    rne,
    tl_precision,
)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    # Both bounds start as int32 tensors so the loop-carried types never change (a literal 0, or
    # num_seqs specialised to a constant when it is 1, would not be).
    lo = tile * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    stride_q_t,
    stride_q_h,
    stride_bt_s,
    stride_o_t,
    stride_o_h,
    num_seqs,
    max_blocks_per_seq,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    row0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if row0 >= q_len:
        return
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks_per_seq * BLOCK_SIZE)
    prefix = seq_len - q_len

    rows = row0 + tl.arange(0, BLOCK_Q)
    row_mask = rows < q_len
    q_pos = prefix + rows
    d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + (q_start + rows)[:, None] * stride_q_t + head * stride_q_h + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_Q], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    stride_s = NUM_KV_HEADS * ROW
    stride_b = BLOCK_SIZE * stride_s
    kv_end = tl.minimum(seq_len, prefix + row0 + BLOCK_Q)
    for start in range(0, kv_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < kv_end
        block = tl.load(block_tables_ptr + seq * stride_bt_s + t // BLOCK_SIZE, mask=t_mask, other=0)
        off = block.to(tl.int64) * stride_b + (t % BLOCK_SIZE) * stride_s + kvh * ROW
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        s = mma(q, tl.trans(kv_operand(k, q, KV_QUANT, INTERP_BF16)), PRECISION, INTERP_BF16)
        s = kv_column_scales(s, k_scale_ptr, off, t_mask, KV_QUANT) * scale
        visible = (t[None, :] <= q_pos[:, None]) & t_mask[None, :]
        s = tl.where(visible, s, NEG_INF)
        # Key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        v = kv_operand(v, q, KV_QUANT, INTERP_BF16)
        pv = kv_column_scales(p, v_scale_ptr, off, t_mask, KV_QUANT)
        acc = acc * alpha[:, None] + mma(rne(pv, INTERP_BF16).to(v.dtype), v, PRECISION, INTERP_BF16)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (q_start + rows)[:, None] * stride_o_t + head * stride_o_h + d[None, :]
    tl.store(o_ptrs, rne(out, INTERP_BF16).to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_attention_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_head_dim(head_dim)
    out = q.new_empty(q.shape)  # contiguous even when q is a strided slice of a fused qkv
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = last_dim_contiguous(q)
    fp32 = q.dtype == torch.float32
    block_q = 32
    block_n = 32 if fp32 and head_dim > 64 else 64  # fp32 tiles are twice the bytes
    grid = (num_tokens // block_q + num_seqs, num_heads)
    k_scales, row, quant = kv_cache_args(k_cache)
    v_scales = kv_cache_args(v_cache)[0]
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_seqs,
        block_tables.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        ROW=row,
        KV_QUANT=quant,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        PRECISION=tl_precision(q.dtype),
        INTERP_BF16=interp_bf16(q.dtype),
        num_warps=4,
    )
    return out
