"""8-bit KV caches: the slot layout every kernel shares, and the quantizer in plain torch.

A cache of int8, float8_e4m3fn or float8_e5m2 is [num_blocks, block_size, num_kv_heads, head_dim + 4]:
each (token, KV head) row holds head_dim codes and then its scale as 4 bytes of fp32; the value is
code * scale, with scale = the row's absmax / the code's largest value (127, 448, 57344). The C++ kernels
(kernels/csrc/cpu_kv_quant.h) and the Triton kernels read and write the same bytes; `quantize_kv` here is
the oracle they are tested against bit for bit, and the store path of the torch reference.

Why per token and head: the scale follows each row, so small models' K rows with a few large channels do
not flatten every other token (docs/engine.md, "8-bit KV cache", has the measured logprob error of this
against a per-tensor scale). Why beside the codes: a slot is read once, codes and scales together, and
the pool stays one tensor per layer and K/V, as the 16-bit caches are.
"""

import torch

KV_SCALE_BYTES = 4  # one fp32 per (token, KV head); engine/kv_memory.py counts the same bytes
# The largest code magnitude of each 8-bit dtype: a row's absmax maps onto it.
KV_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# --kv-cache-dtype names (kv_memory.KV_CACHE_DTYPES) of the 8-bit caches, to their torch dtypes.
KV_QUANT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in KV_QMAX


def cache_head_dim(cache: torch.Tensor) -> int:
    """head_dim of a [.., head_dim (+ 4 for 8-bit)] cache."""
    return cache.shape[-1] - (KV_SCALE_BYTES if is_quantized(cache) else 0)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., head_dim], scales float32 [..., 1]) as views of 8-bit cache rows [..., head_dim + 4]."""
    head_dim = rows.shape[-1] - KV_SCALE_BYTES
    return rows[..., :head_dim], rows[..., head_dim:].view(torch.float32)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes of `dtype` [..., head_dim], scales float32 [..., 1]); an all-zero row
    keeps scale 0. The same operations in the same order as the C++ store (cpu_kv_quant.h quantize_row)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / KV_QMAX[dtype]
    q = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    if dtype == torch.int8:
        return q.round().clamp(-127, 127).to(torch.int8), scale
    return q.to(dtype), scale  # torch's fp8 casts round to nearest even and saturate


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] -> whole cache rows [..., head_dim + 4] of `dtype` (codes, then the scale's bytes)."""
    codes, scale = quantize_kv(x, dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """8-bit cache rows [..., head_dim + 4] -> values [..., head_dim] in `dtype` (code * scale in fp32,
    rounded once to dtype)."""
    codes, scale = split_rows(rows)
    return (codes.float() * scale).to(dtype)
