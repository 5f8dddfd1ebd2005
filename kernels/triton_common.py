"""Small helpers shared by the Triton wrappers (host side only)."""

import functools

import torch
import triton
import triton.language as tl
from tokenmill.kernels import kv_quant


def tl_precision(dtype: torch.dtype) -> str:
    # tl.dot rounds fp32 inputs to tf32 by default; fp32 callers asked for fp32, so use IEEE.
    return "ieee" if dtype == torch.float32 else "tf32"


def interp_bf16(dtype: torch.dtype) -> bool:
    """True when running bf16 through Triton 3.9's interpreter, which gets two bf16 things wrong.

    Measured here: tl.dot on bf16 operands multiplies the raw 16-bit patterns (errors of 1e10), and
    fp32 -> bf16 casts truncate instead of rounding to nearest even (mean relative error -0.26%).
    The kernels then upcast dot operands (exact: fp32 products of bf16 values are what the GPU's
    bf16 MMA computes) and round explicitly, so the interpreter reproduces the compiled numerics.
    """
    return dtype == torch.bfloat16 and triton.knobs.runtime.interpret


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """tl.dot(a, b) accumulating in fp32."""
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def rne(x, INTERP_BF16: tl.constexpr):
    """fp32 x, pre-rounded to bf16 precision (nearest even) on the interpreter; unchanged otherwise.

    Call sites then do x.to(dtype): exact after this rounding, and the compiler rounds to nearest
    itself, so this never changes compiled code.
    """
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def kv_operand(x, q, KV_QUANT: tl.constexpr, INTERP_BF16: tl.constexpr):
    """A K or V tile as a dot operand beside q: 8-bit codes convert exactly (every int8 and fp8 value is a
    bf16, fp16 and fp32 value); the interpreter's int8 -> bf16 cast is wrong, so it gets fp32 (mma upcasts)."""
    if KV_QUANT:
        x = x.to(tl.float32 if INTERP_BF16 else q.dtype)
    return x


@triton.jit
def kv_column_scales(x, scale_ptr, off, t_mask, KV_QUANT: tl.constexpr):
    """x [rows, keys] times each key's scale for an 8-bit cache (its fp32 sits ROW elements after the
    previous row's: off / 4 in fp32 units), so scores and probabilities carry the scales, not the tiles."""
    if KV_QUANT:
        x = x * tl.load(scale_ptr + off // 4, mask=t_mask, other=0.0)[None, :]
    return x


@triton.jit
def round_to_nearest_even(x):
    """fp32 x rounded to an integer, ties to even (|x| < 2^22): adding 1.5 * 2^23 leaves no fraction bits."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def round_to_fp8(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x pre-rounded to an fp8 value with MANT mantissa bits and smallest normal exponent MIN_EXP
    (nearest even) on the interpreter, whose fp32 -> fp8 casts do not round to nearest even (measured:
    e4m3 results 1 ulp off); unchanged when compiled, where the cast itself rounds (cvt.rn.satfinite)."""
    if INTERP:
        bits = x.to(tl.uint32, bitcast=True)
        drop = 23 - MANT
        half = (1 << (drop - 1)) - 1
        normal = (((bits + half + ((bits >> drop) & 1)) >> drop) << drop).to(tl.float32, bitcast=True)
        # Below the smallest normal the spacing is fixed, 2^(MIN_EXP - MANT): round with the magic number.
        magic = 1.5 * 2.0 ** (MIN_EXP - MANT + 23)
        sub = (x + magic) - magic
        x = tl.where(tl.abs(x) < 2.0**MIN_EXP, sub, normal)
    return x


def kv_cache_args(cache: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(scales, row, quantized) for a kernel reading `cache`: an 8-bit cache's fp32 scales (a view at the
    first row's scale; each row's sits row elements after the previous one's), the elements per (token,
    head) row, and whether it is 8-bit (kernels/kv_quant.py). A 16-bit cache passes itself as scales."""
    if not kv_quant.is_quantized(cache):
        return cache, cache.shape[-1], False
    return kv_quant.split_rows(cache)[1], cache.shape[-1], True


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"impl='triton' needs head_dim a power of two >= 16 (e.g. 64, 128), got {head_dim}")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: any small number exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


# Re-exported so kernels can say `NEG_INF` without a float literal in each file.
NEG_INF = tl.constexpr(float("-inf"))
