"""Triton paged decode attention (one query token per sequence), split-KV for small batches.

Grid: (sequence, KV head, split). One program serves all query heads of its KV head, so each K/V
tile is read once per group (GQA); the group is padded to 16 rows because tl.dot needs M >= 16.
Tokens are gathered one row at a time through the block table, so the tile length BLOCK_N is
independent of the cache's block size. With more than one split, each split writes an
unnormalised partial (acc, max, sum) and a second kernel merges them (flash-decoding). The split
count depends only on the batch shape, never on seq_lens values, so the launch is CUDA-graph safe.
An 8-bit cache (kernels/kv_quant.py) is read as codes converted to the query's dtype; each key's scale
multiplies its score column, each value's its probability column, so the dots see exact operands.
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
    num_sms,
    rne,
    tl_precision,
)

_BLOCK_N = 64
_MAX_SPLITS = 16


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    scale,
    stride_q_s,
    stride_q_h,
    stride_bt_s,
    stride_o_s,
    stride_o_h,
    max_blocks_per_seq,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Never read past the table row, even if seq_lens is wrong (the host checks CPU inputs).
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks_per_seq * BLOCK_SIZE)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    t_begin = split * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_begin + tiles_per_split * BLOCK_N, seq_len)

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < GROUP
    head = kvh * GROUP + rows
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_q_s + head[:, None] * stride_q_h + d[None, :], mask=row_mask[:, None], other=0.0
    )

    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    stride_s = NUM_KV_HEADS * ROW
    stride_b = BLOCK_SIZE * stride_s
    for start in range(t_begin, t_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < t_end
        block = tl.load(block_tables_ptr + seq * stride_bt_s + t // BLOCK_SIZE, mask=t_mask, other=0)
        off = block.to(tl.int64) * stride_b + (t % BLOCK_SIZE) * stride_s + kvh * ROW
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        s = mma(q, tl.trans(kv_operand(k, q, KV_QUANT, INTERP_BF16)), PRECISION, INTERP_BF16)
        s = kv_column_scales(s, k_scale_ptr, off, t_mask, KV_QUANT) * scale
        s = tl.where(t_mask[None, :], s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has at least one valid token
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        v = kv_operand(v, q, KV_QUANT, INTERP_BF16)
        pv = kv_column_scales(p, v_scale_ptr, off, t_mask, KV_QUANT)
        acc = acc * alpha[:, None] + mma(rne(pv, INTERP_BF16).to(v.dtype), v, PRECISION, INTERP_BF16)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 -> zeros
        o_ptrs = out_ptr + seq * stride_o_s + head[:, None] * stride_o_h + d[None, :]
        tl.store(o_ptrs, rne(out, INTERP_BF16).to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        # partials: acc [S, H, SPLITS, D], m/l [S, H, SPLITS]
        ml = (seq * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + ml, m_i, mask=row_mask)
        tl.store(part_l_ptr + ml, l_i, mask=row_mask)
        tl.store(part_acc_ptr + ml[:, None] * HEAD_DIM + d[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_o_s,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    sp = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_m_ptr + base + sp)
    l_part = tl.load(part_l_ptr + base + sp)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == NEG_INF, 0.0, m_max)  # all splits empty (seq_len 0): weights become 0
    w = tl.exp(m - m_max)
    denom = tl.sum(w * l_part, 0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_o_s + head * stride_o_h + d, rne(out, INTERP_BF16).to(out_ptr.dtype.element_ty)
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough programs to fill the device about twice over; a function of shapes only (graph-safe)."""
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * num_sms(device), max(programs, 1))
    return min(_MAX_SPLITS, triton.next_power_of_2(want))


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_head_dim(head_dim)
    out = q.new_empty(q.shape)  # contiguous even when q is a strided slice of a fused qkv
    if num_seqs == 0:
        return out
    q = last_dim_contiguous(q)
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, q.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    if num_splits > 1:
        part_acc = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    k_scales, row, quant = kv_cache_args(k_cache)
    v_scales = kv_cache_args(v_cache)[0]
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        block_tables.shape[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        ROW=row,
        KV_QUANT=quant,
        BLOCK_SIZE=block_size,
        BLOCK_N=_BLOCK_N,
        NUM_SPLITS=num_splits,
        PRECISION=tl_precision(q.dtype),
        INTERP_BF16=interp_bf16(q.dtype),
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            INTERP_BF16=interp_bf16(q.dtype),
            num_warps=4,
        )
    return out
