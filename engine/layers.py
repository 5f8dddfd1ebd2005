"""Building blocks of the decoder models: Linear, RMSNorm, rotary embedding (incl. Llama 3 scaling), SiLU-and-mul.

Numerics follow transformers' Llama/Qwen code operation for operation (norm statistics in fp32, the
normalised value cast back before the weight multiply, cos/sin computed in fp32 and cast to the model
dtype), so fp32 outputs agree with transformers to rounding and bf16 outputs round the same way.
"""

import ctypes
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenmill.engine.model_config import RopeScaling
from tokenmill.engine.weight_blocks import find_weight_blocks, to_panels
from tokenmill.kernels import cpu as cpu_kernels
from torch import nn


def _cpu_ops(x: torch.Tensor) -> object | None:
    """The fused C++ CPU ops (kernels/csrc/cpu_layers.cpp) for a CPU tensor, when they built."""
    return cpu_kernels.load() if x.device.type == "cpu" else None


# Batch size oneDNN lays the prepacked weights out for. Measured on the AMX CPU (bf16, 1 thread, a
# [3072, 576] weight): a 256 hint ran batches of 2 to 200 as fast as or faster than unpacked F.linear
# (1.5x at 64 rows, 3x at 200), with bit-identical results; a hint of 1 gained nothing.
PREPACK_BATCH_HINT = 256
# ...but a single row is faster unpacked: streaming all of SmolLM2's weights (cold, as in a decode
# step) took 37 ms through F.linear and 51 ms through the packed copies (same machine, interleaved runs).
PREPACK_MIN_ROWS = 2


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking is for bf16 on CPUs; fp32 stays on F.linear (the parity reference path)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _cpu_can_reorder_bf16()


@functools.cache
def _cpu_can_reorder_bf16() -> bool:
    """oneDNN's bf16 reorder needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT; on other CPUs (AVX2-only
    EPYCs, for one) it raises at model load, so ask the CPU once with a tiny weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PREPACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout; only `packed_linear` can read it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Rows up to which the small-batch kernel (cpu_linear.cpp) runs a linear, which reads each weight once
# per step. On integer blocks larger batches go to the cache-blocked kernel (cpu_gemm.cpp), which ran
# every measured batch of SmolLM2's shapes (32-2048 rows, 2-core AVX2 EPYC) in less CPU time than torch's
# fp32 GEMM, so such a weight keeps no fp32 copy; fp32-panel weights run larger batches through torch.
CPU_PACKED_MAX_ROWS = 16


def cpu_linear_mode() -> str:
    """TOKENMILL_CPU_LINEAR: "1" (default) integer blocks where lossless, fp32 panels otherwise; "fp32"
    fp32 panels only; "0" torch's F.linear. The last two are for A/B runs and bisecting."""
    mode = os.environ.get("TOKENMILL_CPU_LINEAR", "1")
    if mode not in ("0", "1", "fp32"):
        raise ValueError(f"TOKENMILL_CPU_LINEAR must be 0, 1 or fp32, got {mode!r}")
    return mode


# Rows up to which a bf16 model's linears run on the fp32 kernel from the weights' integer codes (x
# widened to fp32, the result rounded to bf16) instead of oneDNN's prepacked bf16 weights: a row reads
# 0.75 bytes per weight (Q4 nibbles with fp32 scale and min per 32) instead of 2. Past 3 rows the
# kernel is compute-bound and oneDNN's bf16 dot products win: SmolLM2's gate_proj, 1 thread, AVX-512
# EPYC at load 3, codes vs prepacked: 1 row 87-96 vs 163-166 us, 3 rows 113-121 vs 153-175, 4 rows
# 141-147 vs 144-158, 6 rows 271-279 vs 167-181 (docs/benchmarks.md, "bf16 from integer codes").
BF16_CODES_MAX_ROWS = 3
# ...and where the CPU has AVX-512 BF16, the codes' own bf16 dot kernel (cpu_linear_bf16.cpp), which
# multiplies by the codes as bf16 operands, up to this many rows. Decode steps of the bundled model,
# `bench roofline --dtype bfloat16 --threads 2`, this kernel up to 256 rows vs oneDNN from 1 row (AVX-512
# BF16 EPYC, two runs each): 16 rows 36.0-39.8 vs 41.1-41.9 ms, 32 rows 57.4-59.4 vs 57.5-63.0, 64 rows
# 110.8-118.4 vs 102.4-104.8, 128 rows 196-213 vs 157-169: past 32 rows oneDNN's register tiles win.
BF16_DOT_MAX_ROWS = 32
# ...and where the CPU has AMX-BF16, the codes' AMX tile kernel (cpu_linear_amx.cpp) takes batches from
# AMX_MIN_ROWS rows; fewer rows stay on the dot kernel. The 30 layers' linears of the bundled model (a
# throwaway loop, 2 threads, 2-vCPU Xeon with AMX, the same process alternating; docs/benchmarks.md),
# dot / AMX / oneDNN in ms: 1 row 7.4 / 9.5 / 17.0, 3 rows
# 8.5 / 9.3 / 16.1, 4 rows 10.1 / 9.9 / 17.0, 16 rows 23.8 / 9.1 / 17.6, 64 rows 81 / 20.7 / 23.7,
# 128 rows 163 / 34.7 / 27.6.
AMX_MIN_ROWS = 4
# From AMX_DEQUANT_MIN_ROWS the AMX path rebuilds each panel's bf16 weights from the codes once per call
# and runs a plain tile GEMM (linear_dequant_amx) instead of scaling every block's tile
# (linear_codes_amx): the bf16 model's weights, as oneDNN multiplies them, read as codes. It takes
# batches up to AMX_CODES_MAX_ROWS; more go to oneDNN. Same loop as above on a noisier day, one process
# alternating, codes AMX / dequant AMX / oneDNN, ms: 16 rows 13.7 / 15.5 / 23.4, 24 rows 21.8 / 18.9 /
# 25.6, 32 rows 21.4 / 17.3 / 26.3, 64 rows 32.4 / 25.5 / 31.0, 96 rows 40.7 / 29.3 / 32.8, 128 rows
# 49.9 / 35.3 / 43.6; past that oneDNN and this one trade places (160 rows 36.1 vs 44.6, 256 rows
# 48.2 vs 44.6): docs/benchmarks.md.
AMX_DEQUANT_MIN_ROWS = 24
AMX_CODES_MAX_ROWS = 128
# The LM head (Q8 codes, 49,152 x 576) crosses over earlier: its int8 codes cost more to turn into B
# tiles than nibbles. Same machine, one call, AMX vs oneDNN (+ the cast to fp32 logits), ms: 16 rows
# 2.45 vs 3.55, 32 rows 4.26 vs 4.96, 64 rows 8.35 vs 6.14; the dequant kernel, one weight in a loop:
# 64 rows 3.76 vs 2.79.
AMX_LOGITS_MAX_ROWS = 32


@functools.cache
def bf16_dot_supported() -> bool:
    """Whether the bf16 dot kernel on integer codes built (a CPU with AVX-512 BF16)."""
    ops = cpu_kernels.load()
    return ops is not None and ops.linear_codes_bf16_supported()


@functools.cache
def amx_codes_supported() -> bool:
    """Whether the AMX tile kernel on integer codes built and may run (a CPU with AMX-BF16, and Linux
    granted this process the tile state). TOKENMILL_CODES_AMX=0 turns it off, for A/B runs."""
    if os.environ.get("TOKENMILL_CODES_AMX", "1") == "0":
        return False
    ops = cpu_kernels.load()
    return ops is not None and bf16_dot_supported() and ops.linear_codes_amx_supported()


@functools.cache
def amx_dequant_min_rows() -> int:
    """AMX_DEQUANT_MIN_ROWS, or TOKENMILL_AMX_DEQUANT_ROWS for A/B runs (read once per process)."""
    return int(os.environ.get("TOKENMILL_AMX_DEQUANT_ROWS", AMX_DEQUANT_MIN_ROWS))


@functools.cache
def bf16_codes_max_rows() -> int:
    """Rows up to which a bf16 model's linears run from their integer codes (the rest: oneDNN).
    TOKENMILL_BF16_CODES_ROWS overrides it, for A/B runs (read once per process)."""
    env = os.environ.get("TOKENMILL_BF16_CODES_ROWS")
    if env is not None:
        return int(env)
    if amx_codes_supported():
        return AMX_CODES_MAX_ROWS
    return BF16_DOT_MAX_ROWS if bf16_dot_supported() else BF16_CODES_MAX_ROWS


@functools.cache
def bf16_logits_max_rows() -> int:
    """bf16_codes_max_rows for the LM head: on the AMX kernel, at most AMX_LOGITS_MAX_ROWS."""
    if amx_codes_supported() and os.environ.get("TOKENMILL_BF16_CODES_ROWS") is None:
        return min(bf16_codes_max_rows(), AMX_LOGITS_MAX_ROWS)
    return bf16_codes_max_rows()


def bf16_codes_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a bf16 CPU model should keep its weights' integer codes for small batches: the codes are
    found in the fp32 weights, so such a model is loaded in fp32 and cast after (ModelRunner)."""
    return can_prepack(device, dtype) and fp32_linear_ops(device, torch.float32) is not None and (
        cpu_linear_mode() == "1"
    )


def fp32_linear_ops(device: torch.device, dtype: torch.dtype) -> object | None:
    """The C++ ops when fp32 linears can run on packed weights (kernels/csrc/cpu_linear.cpp: a CPU with
    AVX2 + FMA and the kernels built); None otherwise, or with TOKENMILL_CPU_LINEAR=0."""
    if device.type != "cpu" or dtype != torch.float32 or cpu_linear_mode() == "0":
        return None
    ops = cpu_kernels.load()
    if ops is None or not ops.packed_linear_supported():
        return None
    return ops


@dataclass
class CpuPackedWeight:
    """A weight [out_features, in] in the fp32 kernel's panels: fp32 values, or int8 codes with per-block
    scales and mins that rebuild those fp32 values exactly (engine/weight_blocks.py)."""

    out_features: int
    fp32: torch.Tensor | None = None  # [panels, in, 16]
    codes: torch.Tensor | None = None  # int8 [panels, in, 16], or uint8 nibbles [panels, in / 2, 16]
    scales: torch.Tensor | None = None  # [panels, in / 32, 16]: fp32, or fp16 for the bf16 kernels
    mins: torch.Tensor | None = None

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias, fp32), in x's dtype (or out_dtype: fp32 logits from bf16 x on the
        bf16 dot kernel): fp32, or bf16 on codes for up to CPU_PACKED_MAX_ROWS rows (an fp32 sum rounded
        once). bf16 rows on codes run the AVX-512 BF16 dot kernel, or from AMX_MIN_ROWS rows the AMX one."""
        # A decode step makes ~120 of these calls: 2-D inputs skip the reshape and view (each ~1 us).
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype or x.dtype, device=x.device)
        ops = cpu_kernels.load()
        if x.dtype == torch.bfloat16 and self.codes is not None and bf16_dot_supported():
            op = ops.linear_codes_bf16
            if rows.shape[0] >= AMX_MIN_ROWS and amx_codes_supported():
                op = ops.linear_dequant_amx if rows.shape[0] >= amx_dequant_min_rows() else ops.linear_codes_amx
            op(out, rows, self.codes, self.scales, self.mins, bias)
        elif rows.dtype != out.dtype:  # fp32 logits of bf16 rows without the dot kernel: widen x
            return self.linear(x.to(out.dtype), bias)
        elif self.codes is None:
            ops.linear_packed(out, rows, self.fp32, bias)
        elif rows.shape[0] > CPU_PACKED_MAX_ROWS:
            ops.linear_q8_gemm(out, rows, self.codes, self.scales, self.mins, bias)
        else:
            ops.linear_packed_q8(out, rows, self.codes, self.scales, self.mins, bias)
        return out if flat else out.view(*x.shape[:-1], self.out_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] of the weight [T, in], rebuilt from the codes: the fp32 values it was loaded with."""
        if self.codes.dtype != torch.int8:
            raise ValueError("embedding rows are read from int8 codes; this weight was packed as nibbles")
        out = torch.empty(ids.shape[0], self.codes.shape[1], dtype=torch.float32)
        ids = ids if ids.dtype == torch.int64 else ids.long()
        cpu_kernels.load().embedding_q8(out, ids, self.codes, self.scales, self.mins, self.out_features)
        return out

    @property
    def nbytes(self) -> int:
        parts = (self.fp32, self.codes, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim). Weights of a few MB can sit in the
    heap rather than in their own mappings (glibc raises its mmap threshold up to 32 MB as mapped blocks
    are freed), and freeing them then leaves the process's RSS as it was."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def nibble_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 code panels [P, K, 16] with every code in 0..15 -> uint8 [P, K / 2, 16], k = 2j in the low and
    k = 2j + 1 in the high 4 bits of row j: the kernels' nibble layout (half the bytes to read)."""
    pairs = codes.view(codes.shape[0], codes.shape[1] // 2, 2, codes.shape[2]).to(torch.uint8)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()


def codes_weight(weight: torch.Tensor, nibbles: bool = True) -> CpuPackedWeight | None:
    """An fp32 weight [out, in] as the kernel's integer-code panels, when integer blocks rebuild it
    exactly; None otherwise. Codes that all fit 0..15 (GGUF Q4_*) are stored two to a byte where
    `nibbles` (not for a tied embedding, whose rows embedding_q8 reads one code per byte)."""
    found = find_weight_blocks(weight.detach())
    if found is None:
        return None
    codes = to_panels(found.codes)
    if nibbles and bool(((codes >= 0) & (codes <= 15)).all()):
        codes = nibble_codes(codes)
    return CpuPackedWeight(weight.shape[0], codes=codes, scales=to_panels(found.scales), mins=to_panels(found.mins))


def bf16_codes_weight(weight: torch.Tensor, nibbles: bool = True) -> CpuPackedWeight | None:
    """codes_weight for a model cast to bf16 next. Where its rows run on the bf16 kernels (AVX-512 BF16:
    dot and AMX), the scales and mins are kept as fp16 when every one is an fp16 value, as GGUF stores
    them: 0.625 bytes per Q4 weight instead of 0.75, the same results bit for bit."""
    packed = codes_weight(weight, nibbles)
    if packed is not None and bf16_dot_supported():
        scales, mins = packed.scales.half(), packed.mins.half()
        if torch.equal(scales.float(), packed.scales) and torch.equal(mins.float(), packed.mins):
            packed.scales, packed.mins = scales, mins
    return packed


def pack_cpu_weight(weight: torch.Tensor, blocks: bool | None = None, nibbles: bool = True) -> CpuPackedWeight:
    """Pack an fp32 weight [out, in] for the fp32 CPU kernel: as integer blocks when they rebuild it
    exactly (and `blocks`, by default unless TOKENMILL_CPU_LINEAR=fp32), else as fp32 panels."""
    weight = weight.detach()
    if blocks is None:
        blocks = cpu_linear_mode() == "1"
    packed = codes_weight(weight, nibbles) if blocks else None
    if packed is not None:
        return packed
    return CpuPackedWeight(weight.shape[0], fp32=cpu_kernels.load().pack_linear_weight(weight))


class Linear(nn.Linear):
    """nn.Linear whose weight can be swapped for a packed copy after loading: oneDNN's blocked layout
    for bf16, or the fp32 AVX2 kernel's panels.

    Unpacked, oneDNN re-lays-out the whole weight on every bf16 call; for the small batches of a
    decode step that costs as much as the product itself. torch's fp32 GEMM on AVX2 ran 8 rows at a
    quarter of one row's bandwidth (docs/benchmarks.md); the packed kernel reads each weight once per
    step, from int8 codes where the weight has them.
    """

    packed: torch.Tensor | None = None
    packed_cpu: CpuPackedWeight | None = None
    bias_fp32: torch.Tensor | None = None  # a bf16 model's bias for the codes kernel (attach_codes)

    def prepack(self) -> None:
        """oneDNN's bf16 layout. A weight that also has integer codes (attach_codes) runs single rows
        from them, so its unpacked bf16 copy, which only single rows read, is dropped."""
        self.packed = prepack_weight(self.weight)
        if self.packed_cpu is not None:
            self.weight = None

    def attach_codes(self) -> None:
        """Keep the integer-code form of this fp32 weight, if it has one, for a model cast to bf16 next
        (with the fp32 bias the kernel adds)."""
        self.packed_cpu = bf16_codes_weight(self.weight)
        self.bias_fp32 = None if self.bias is None else self.bias.detach().float().clone()

    def pack_cpu(self, blocks: bool | None = None, keep_fp32: bool = False) -> None:
        """Pack for the fp32 CPU kernel. A weight found as integer blocks then runs every batch from its
        codes and its [out, in] fp32 copy is dropped (unless keep_fp32); an fp32-panel weight keeps it,
        for batches over CPU_PACKED_MAX_ROWS rows, which run faster through torch's GEMM."""
        self.packed_cpu = pack_cpu_weight(self.weight, blocks)
        if self.packed_cpu.codes is not None and not keep_fp32:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed_cpu = self.packed_cpu
        if packed_cpu is not None:
            rows = x.numel() // x.shape[-1]
            if x.dtype == torch.bfloat16:
                if rows <= bf16_codes_max_rows():
                    return packed_cpu.linear(x, self.bias_fp32)
            elif self.weight is None or rows <= CPU_PACKED_MAX_ROWS:  # fp32
                return packed_cpu.linear(x, self.bias)
        if self.packed is not None and (x.shape[0] >= PREPACK_MIN_ROWS or self.weight is None):
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op instead of five (pow, mean, add, rsqrt, mul): per-op overhead dominates small
        # batches on CPU. Statistics stay in fp32, as in transformers.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if h.dtype != x.dtype:
            h = h.to(x.dtype)
        return h.mul_(self.weight)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).

        The residual form adds into x in place (x must be a fresh activation the caller owns), which
        saves one [tokens, hidden] allocation per norm.
        """
        ops = _cpu_ops(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1 and self.weight.dtype == x.dtype:
            out = torch.empty_like(x)
            if residual is None:
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            ops.add_rms_norm(out, x, residual, self.weight, self.eps)
            return out, x
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with Llama 3's smooth low/high-frequency scaling."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band in between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE with a cos/sin table over every position, built once per device/dtype.

    A plain object, not a module: the table is derived state, never loaded from a checkpoint.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None) -> None:
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _build(self, device: torch.device, dtype: torch.dtype) -> None:
        # Built on the CPU (the model may be constructed under a meta-device context), then moved.
        inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling)
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, head_dim // 2]
        self._cos = freqs.cos().to(device=device, dtype=dtype)
        self._sin = freqs.sin().to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim // 2] for the given positions; computed once per forward."""
        cos, sin = self.tables(positions.device, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [max_position, head_dim // 2]."""
        if self._cos is None or self._cos.dtype != dtype or self._cos.device != device:
            self._build(device, dtype)
        return self._cos, self._sin

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """What every layer of one forward needs to rotate its queries and keys."""
        if _cpu_ops(positions) is not None:
            cos, sin = self.tables(positions.device, dtype)
            return Rope(positions, cos, sin, gathered=False)
        cos, sin = self.cos_sin(positions, dtype)
        return Rope(positions, cos, sin, gathered=True)


@dataclass(slots=True)
class Rope:
    """Rotary inputs of one forward: full tables for the fused CPU op, or cos/sin gathered per token."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    gathered: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, num_heads, head_dim]: in place by the fused CPU op, else into a new tensor."""
        if not self.gathered:
            ops = cpu_kernels.load()
            ops.rotary_neox(x, self.positions, self.cos, self.sin)
            return x
        return apply_rotary(x, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] -> a new contiguous tensor of the same shape."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1 = out[..., :half]
    o2 = out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    d = x.shape[-1] // 2
    ops = _cpu_ops(x)
    if ops is not None and x.dim() == 2 and x.stride(1) == 1:
        out = x.new_empty(x.shape[0], d)
        ops.silu_and_mul(out, x)
        return out
    return F.silu(x[..., :d]).mul_(x[..., d:])
