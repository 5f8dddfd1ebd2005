"""Triton KV-cache write: one program per token copies its K and V rows into the token's slot, or for an
8-bit cache (kernels/kv_quant.py) writes each row's codes and its fp32 scale, bit for bit what
kv_quant.quantize_rows gives."""

import torch
import triton
import triton.language as tl
from tokenmill.kernels import kv_quant
from tokenmill.kernels.triton_common import (
    check_head_dim,
    kv_cache_args,
    last_dim_contiguous,
    round_to_fp8,
    round_to_nearest_even,
)


@triton.jit
def _quantize(x, mask, QMAX: tl.constexpr, INT8: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
              INTERP: tl.constexpr):
    """Rows x [BLOCK_H, HEAD_DIM] -> (codes as fp32 values, scales [BLOCK_H]); kv_quant.quantize_kv's steps.
    div_rn: Triton's plain `/` on fp32 is an approximate division on the GPU."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    scale = tl.div_rn(tl.max(tl.abs(x), 1), QMAX)
    q = tl.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
    if INT8:
        q = tl.minimum(tl.maximum(round_to_nearest_even(q), -127.0), 127.0)
    else:
        q = tl.minimum(tl.maximum(round_to_fp8(q, MANT, MIN_EXP, INTERP), -QMAX), QMAX)
    return q, scale


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    INT8: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    INTERP: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return  # padding token: nothing to write
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    row = slot * (NUM_KV_HEADS * ROW) + h * ROW  # slot is int64: no overflow on big caches
    k = tl.load(key_ptr + tok * stride_key_t + h * stride_key_h + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_value_t + h * stride_value_h + d, mask=mask)
    if KV_QUANT:
        k, k_scale = _quantize(k, mask, QMAX, INT8, MANT, MIN_EXP, INTERP)
        v, v_scale = _quantize(v, mask, QMAX, INT8, MANT, MIN_EXP, INTERP)
        # The scale's fp32 sits right after its row's codes: row / 4 in fp32 units of the scales view.
        tl.store(k_scale_ptr + row // 4, k_scale[:, None], mask=mask)
        tl.store(v_scale_ptr + row // 4, v_scale[:, None], mask=mask)
    tl.store(k_cache_ptr + row + d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + row + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# (mantissa bits, smallest normal exponent) of the fp8 formats, for the interpreter's rounding.
_FP8_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens = key.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], key.shape[2]
    check_head_dim(head_dim)
    if num_tokens == 0:
        return
    key = last_dim_contiguous(key)
    value = last_dim_contiguous(value)
    k_scales, row, quant = kv_cache_args(k_cache)
    mant, min_exp = _FP8_FORMAT.get(k_cache.dtype, (0, 0))
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scales,
        kv_cache_args(v_cache)[0],
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        KV_QUANT=quant,
        QMAX=kv_quant.KV_QMAX.get(k_cache.dtype, 1.0),
        INT8=k_cache.dtype == torch.int8,
        MANT=mant,
        MIN_EXP=min_exp,
        INTERP=triton.knobs.runtime.interpret,
    )
