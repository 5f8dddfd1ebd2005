"""Triton KV-cache write: one program per token copies its K and V rows into the token's slot."""

import torch
import triton
import triton.language as tl
from tokenmill.kernels.triton_common import check_head_dim, last_dim_contiguous


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return  # padding token: nothing to write
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d  # slot is int64: no overflow on big caches
    k = tl.load(key_ptr + tok * stride_key_t + h * stride_key_h + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + tok * stride_value_t + h * stride_value_h + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens = key.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    check_head_dim(head_dim)
    if num_tokens == 0:
        return
    key = last_dim_contiguous(key)
    value = last_dim_contiguous(value)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )
