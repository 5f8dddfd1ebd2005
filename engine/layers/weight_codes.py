"""Find, without loss, the integer-block form of an fp32 weight that was dequantized from GGUF blocks.

A GGUF model (the bundled one: Q4_1 projections, a Q8_0 embedding) is converted to fp32 at download
(gguf_convert.py), so every weight is w = scale * code + min per block of 32 along a row, with small
integer codes. The fp32 CPU kernel reads such weights as int8 codes plus one scale and min per block,
1.25 bytes per weight instead of 4 (kernels/csrc/cpu_linear.cpp). This module recovers scale, min and
codes from the fp32 values and keeps them only when rebuilding gives back every fp32 weight bit for bit;
a weight that was never quantized (an HF safetensors model) fails that check and stays fp32. So the
model computes with exactly the weights it loaded, from a quarter of the bytes.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
from tokenmill.kernels import cpu as cpu_kernels

BLOCK = 32  # weights per scale/min pair along a row: GGUF's block size for Q4_0/Q4_1/Q8_0


class CodesCache(Protocol):
    """Codes found at an earlier start (model/weight_codes_cache.py), read back instead of searched for
    (about 1 s of the bundled model's start); the worker passes one while it packs the weights."""

    def get(self, weight: torch.Tensor) -> "WeightCodes | None": ...
    def put(self, weight: torch.Tensor, blocks: "WeightCodes") -> None: ...


@dataclass
class WeightCodes:
    """w[n, k] == scales[n, k // 32] * codes[n, k] + mins[n, k // 32] in float32 for every element; the
    product is exact (an fp16 scale times a small integer), so the kernel's fused multiply-add gives it."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / 32]
    mins: torch.Tensor  # float32 [N, K / 32]


def find_weight_codes(weight: torch.Tensor, cache: CodesCache | None = None) -> WeightCodes | None:
    """The lossless integer-block form of a 2-D float32 weight, or None when some block has none.

    Per block of 32 along a row the C++ op (kernels/csrc/cpu_linear.cpp, `fit_block`) tries codes
    0..15 above the block's smallest value with an fp16 scale (GGUF Q4_1 as llama.cpp's reference
    quantizer writes it), signed codes with min 0 (Q8_0), then narrower code spans (Q4_1 blocks whose
    codes miss 0 or 15), and keeps a form only if every weight rebuilds bit for bit. A weight that was
    never quantized fails at its first blocks, so checking an fp32 model costs next to nothing.
    """
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    ops = cpu_kernels.load()
    if ops is None:
        return None
    if cache is not None and (known := cache.get(weight)) is not None:
        return known
    codes, scales, mins, ok = ops.find_weight_blocks(weight.detach())
    found = WeightCodes(codes, scales, mins) if ok else None
    if cache is not None and found is not None:
        cache.put(weight, found)
    return found


def to_panels(t: torch.Tensor, panel: int = 16) -> torch.Tensor:
    """[N, C] -> [ceil(N / panel), C, panel]: column-interleaved panels, the last zero-padded."""
    n = t.shape[0]
    pad = -n % panel
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, panel, t.shape[1]).transpose(1, 2).contiguous()
