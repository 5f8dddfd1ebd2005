"""Weights held as their quantized file holds them: GGUF K-quants (Q4_K, Q5_K, Q6_K), Q5_0 / Q5_1, and AWQ /
GPTQ int4 with zero points, in the kernels' "grouped" layout (kernels/csrc/cpu_grouped.cpp has it in
full). Built by the loaders (engine/model/gguf_weights.py, engine/model/int4_weights.py); never from
an fp32 copy.

w[n, k] = (d[n, k / group] * sc[n, k / block]) * (q[n, k] - offset) - dmin[n, k / group] * mn[n, k / block]

On the CPU with the C++ kernels a linear runs from the codes: bf16 rows on the AVX-512 BF16 dot kernel,
fp32 rows on exact float32 rebuilds of each panel (equal, bit for bit, to the fp32 kernels on the
dequantized weights), or with `--int8-activations` on 4-bit formats, x rounded to int8 per 32 in integer
dot products (kernels/csrc/cpu_codes_int8.cpp). Elsewhere (CUDA, or no compiler) each call dequantizes the weight with torch ops
(dequantize below, also the tests' reference) and runs F.linear: the memory of the codes, not the speed
of a fused kernel.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenmill.engine.layers.cpu_gemm_policy import CPU_PACKED_MAX_ROWS
from tokenmill.engine.quant_memory import GroupedFormat
from tokenmill.kernels import cpu as cpu_kernels

PANEL = 16


@dataclass
class GroupedPackedWeight:
    """One [out_features, K] weight in the grouped layout (panels of 16 rows, the last zero-padded)."""

    out_features: int
    fmt: GroupedFormat
    lo: torch.Tensor  # uint8 [P, K / 2, 16]: bits 0-3 of each code, k = 2j low nibble, 2j + 1 high
    hi: torch.Tensor  # int32 [P, K / 2, bits - 4]: bit planes (cpu_grouped.cpp)
    sc: torch.Tensor  # int8 [P, K / block, 16]
    mn: torch.Tensor  # int8 [P, K / block, 16], or empty
    d: torch.Tensor  # float16 [P, K / group, 16]
    dmin: torch.Tensor  # float16 [P, K / group, 16], or empty
    # The dtype embedding() returns (the model's); linear() returns x's.
    embed_dtype: torch.dtype = torch.float32
    # Rows round x to int8 per 32 (EngineConfig.int8_activations; int8x_supported formats only): fp32 rows up to
    # CPU_PACKED_MAX_ROWS, bf16 rows (VNNI builds only) at every batch size sent here, as on the codes layout (linear.py).
    int8_x: bool = False

    @property
    def int8x_supported(self) -> bool:
        """Whether the int8-activation kernel takes this format: 4-bit codes in 32-weight blocks, no offset
        (Q4_K, AWQ / GPTQ int4), whose low nibbles are the codes kernels' nibble panels."""
        return self.fmt.bits == 4 and self.fmt.block == 32 and self.fmt.offset == 0

    @property
    def in_features(self) -> int:
        return self.lo.shape[1] * 2

    @property
    def fmt_list(self) -> list[int]:
        return [self.fmt.bits, self.fmt.block, self.fmt.group, self.fmt.offset]

    @property
    def nbytes(self) -> int:
        parts = (self.lo, self.hi, self.sc, self.mn, self.d, self.dmin)
        return sum(t.numel() * t.element_size() for t in parts)

    def _kernels(self, x: torch.Tensor) -> object | None:
        return cpu_kernels.load() if x.device.type == "cpu" else None

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x [..., K] @ W.T (+ bias, fp32) in x's dtype (or out_dtype: fp32 logits from bf16 x)."""
        ops = self._kernels(x)
        if ops is None or x.dtype not in (torch.float32, torch.bfloat16):
            w = self.dequantize(x.dtype)
            out = F.linear(x, w, None if bias is None else bias.to(x.dtype))
            return out if out_dtype is None else out.to(out_dtype)
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1 or rows.stride(0) % 2:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype or x.dtype, device=x.device)
        if out.dtype != x.dtype and x.dtype == torch.float32:
            out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        # int8 activations up to CPU_PACKED_MAX_ROWS rows, as on the codes layout (linear.py): past that (prompt
        # chunks) the exact kernel ran as fast on the bundled model, and rounding there costs parity (engine.md)
        # bf16 rows (VNNI: vpdpbusd outran the bf16 kernels at every batch measured) at every batch size.
        int8 = self.int8_x and (
            rows.dtype == torch.bfloat16 or (out.dtype == rows.dtype == torch.float32 and rows.shape[0] <= CPU_PACKED_MAX_ROWS)
        )
        op = ops.linear_grouped_int8x if int8 else ops.linear_grouped
        op(out, rows, self.lo, self.hi, self.sc, self.mn, self.d, self.dmin, self.fmt_list, bias)
        if out_dtype is not None and out.dtype != out_dtype:
            out = out.to(out_dtype)
        return out if flat else out.view(*x.shape[:-1], self.out_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] of the weight, exactly as dequantized (rounded once to embed_dtype)."""
        ids = ids if ids.dtype == torch.int64 else ids.long()
        ops = self._kernels(ids)
        if ops is None or self.embed_dtype not in (torch.float32, torch.bfloat16):
            return F.embedding(ids, self.dequantize(torch.float32)).to(self.embed_dtype)
        out = torch.empty(ids.shape[0], self.in_features, dtype=self.embed_dtype)
        ops.embedding_grouped(out, ids, self.lo, self.hi, self.sc, self.mn, self.d, self.dmin, self.fmt_list,
                              self.out_features)  # fmt: skip
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out_features, K] in float32 (then cast to dtype), in torch ops on the codes' device."""
        return dequantize_grouped(self)[: self.out_features].to(dtype)

    def to(self, device: torch.device) -> "GroupedPackedWeight":
        parts = {k: getattr(self, k).to(device) for k in ("lo", "hi", "sc", "mn", "d", "dmin")}
        return GroupedPackedWeight(self.out_features, self.fmt, embed_dtype=self.embed_dtype, **parts)


def grouped_codes(w: GroupedPackedWeight) -> torch.Tensor:
    """The integer codes q [P * 16, K] (int32) of a grouped weight, rows in order."""
    lo = w.lo.to(torch.int32)
    q = torch.stack([lo & 15, lo >> 4], dim=2)  # [P, K / 2, 2, 16]
    planes = w.hi.shape[2]
    if planes:
        shift = (2 * torch.arange(PANEL, device=lo.device)[None, :] + torch.arange(2, device=lo.device)[:, None])  # [2, 16]
        for h in range(planes):
            bits = (w.hi[:, :, h, None, None] >> shift) & 1  # [P, K / 2, 2, 16]
            q = q | (bits << (4 + h))
    p, half = lo.shape[0], lo.shape[1]
    return q.reshape(p, 2 * half, PANEL).transpose(1, 2).reshape(p * PANEL, 2 * half)


def dequantize_grouped(w: GroupedPackedWeight) -> torch.Tensor:
    """float32 [P * 16, K]: the module docstring's formula in torch ops (each product of an fp16 and an int8
    is exact in float32; the one rounding is the last multiply or subtract, as in gguf-py)."""
    fmt = w.fmt

    def rows(t: torch.Tensor) -> torch.Tensor:  # [P, C, 16] -> [P * 16, C]
        return t.transpose(1, 2).reshape(-1, t.shape[1]).float()

    q = grouped_codes(w).float() - fmt.offset
    scale = rows(w.d).repeat_interleave(fmt.group // fmt.block, dim=1) * rows(w.sc)
    out = scale.repeat_interleave(fmt.block, dim=1) * q
    if fmt.has_min:
        low = rows(w.dmin).repeat_interleave(fmt.group // fmt.block, dim=1) * rows(w.mn)
        out = out - low.repeat_interleave(fmt.block, dim=1)
    return out


@dataclass
class SplitPackedWeight:
    """A fused parameter (qkv_proj, gate_up_proj) whose parts are held in different layouts: a GGUF
    Q4_K_M stores q and k as Q4_K but v as Q6_K. Each part runs its own kernel; outputs are concatenated."""

    parts: list  # packed weights (CpuPackedWeight, GroupedPackedWeight), in row order

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        outs, first = [], 0
        for p in self.parts:
            part_bias = None if bias is None else bias[first : first + p.out_features]
            outs.append(p.linear(x, part_bias, out_dtype))
            first += p.out_features
        return torch.cat(outs, dim=-1)


@dataclass
class CodesEmbedding:
    """The embedding lookup of a weight in cpu_linear.cpp's codes layout (GGUF Q4_0 / Q4_1 / Q8_0), in the
    model's dtype: the rows its codes rebuild, rounded once (a tied embedding shares the codes with the LM
    head; VocabParallelEmbedding calls embedding())."""

    packed: object  # layers.linear.CpuPackedWeight
    embed_dtype: torch.dtype

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids if ids.dtype == torch.int64 else ids.long()
        p = self.packed
        out = torch.empty(ids.shape[0], p.scales.shape[1] * 32, dtype=self.embed_dtype)
        cpu_kernels.load().embedding_codes(out, ids, p.codes, p.scales, p.mins, p.out_features)
        return out
