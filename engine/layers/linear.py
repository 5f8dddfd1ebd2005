"""Linear layers and their packed CPU forms: oneDNN's prepacked bf16 weights, the fp32 kernel's panels, and
integer-code panels (weight_codes.py) that rebuild a dequantized GGUF weight exactly from a quarter of the
bytes. Which of them runs a given batch is cpu_gemm_policy.py's decision.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenmill.engine.layers.cpu_gemm_policy import (
    AMX_MIN_ROWS,
    CPU_PACKED_MAX_ROWS,
    PREPACK_BATCH_HINT,
    PREPACK_MIN_ROWS,
    amx_codes_supported,
    amx_dequant_min_rows,
    bf16_codes_dense_min_rows,
    bf16_codes_max_rows,
    bf16_dot_supported,
    bf16_gemm_min_rows,
    cpu_linear_mode,
    dense_bf16_max_rows,
)
from tokenmill.engine.layers.weight_codes import CodesCache, find_weight_codes, to_panels
from tokenmill.kernels import cpu as cpu_kernels
from torch import nn


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout; only `packed_linear` can read it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass
class CpuPackedWeight:
    """A weight [out_features, in] in the fp32 kernel's panels: fp32 values (stored as bf16 where every one
    is a bf16 value: a bf16 checkpoint served in fp32), or int8 codes with per-block scales and mins that
    rebuild those fp32 values exactly (engine/layers/weight_codes.py)."""

    out_features: int
    fp32: torch.Tensor | None = None  # float32 or bfloat16 [panels, in, 16]
    codes: torch.Tensor | None = None  # int8 [panels, in, 16], or uint8 nibbles [panels, in / 2, 16]
    scales: torch.Tensor | None = None  # [panels, in / 32, 16]: fp32, or fp16 for the bf16 kernels
    mins: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # bf16 [panels, in / 2, 32]: a bf16 weight as pack_bf16_weight lays it out
    # Rows on the codes round x to int8 per 32 (kernels/csrc/cpu_codes_int8.cpp): EngineConfig.int8_activations.
    # fp32 rows up to CPU_PACKED_MAX_ROWS; bf16 rows (VNNI builds only) at every batch size that reaches the codes
    # (Linear.forward: bf16_codes_max_rows, unbounded on AVX-512 BF16 CPUs without AMX, 128 rows with AMX).
    int8_x: bool = False

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias, fp32), in x's dtype (or out_dtype: fp32 logits from bf16 x on the
        bf16 dot kernel): fp32, or bf16 on codes for up to CPU_PACKED_MAX_ROWS rows (an fp32 sum rounded
        once). bf16 rows on codes run the AVX-512 BF16 dot kernel, or from AMX_MIN_ROWS rows the AMX one,
        or from bf16_codes_dense_min_rows rows the dense kernel on rebuilt codes; dense bf16 panels the
        dense dot kernel; either from bf16_gemm_min_rows rows the fp32-FMA GEMM. With int8_x, bf16 rows on
        codes take the int8-activation kernel at every batch size they are sent."""
        # A decode step makes ~120 of these calls: 2-D inputs skip the reshape and view (each ~1 us).
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype or x.dtype, device=x.device)
        ops = cpu_kernels.load()
        if self.int8_x and x.dtype == torch.bfloat16 and self.codes is not None:
            ops.linear_codes_int8x(out, rows, self.codes, self.scales, self.mins, bias)
        elif self.dense is not None:
            op = ops.linear_dense_gemm if rows.shape[0] >= bf16_gemm_min_rows() else ops.linear_dense_bf16
            op(out, rows, self.dense, bias)
        elif x.dtype == torch.bfloat16 and self.codes is not None and bf16_dot_supported():
            op = ops.linear_codes_bf16
            if rows.shape[0] >= bf16_gemm_min_rows():
                op = ops.linear_codes_gemm
            elif rows.shape[0] >= AMX_MIN_ROWS and amx_codes_supported():
                op = ops.linear_dequant_amx if rows.shape[0] >= amx_dequant_min_rows() else ops.linear_codes_amx
            elif rows.shape[0] >= bf16_codes_dense_min_rows():
                op = ops.linear_codes_dense
            op(out, rows, self.codes, self.scales, self.mins, bias)
        elif rows.dtype != out.dtype:  # fp32 logits of bf16 rows without the dot kernel: widen x
            return self.linear(x.to(out.dtype), bias)
        elif self.codes is None:
            ops.linear_packed(out, rows, self.fp32, bias)
        elif rows.shape[0] > CPU_PACKED_MAX_ROWS:
            ops.linear_q8_gemm(out, rows, self.codes, self.scales, self.mins, bias)
        elif self.int8_x and rows.dtype == torch.float32:
            ops.linear_codes_int8x(out, rows, self.codes, self.scales, self.mins, bias)
        else:
            ops.linear_packed_q8(out, rows, self.codes, self.scales, self.mins, bias)
        return out if flat else out.view(*x.shape[:-1], self.out_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] of the weight [T, in], rebuilt from the codes or bf16 panels: the fp32 values it was
        loaded with (or, for a dense bf16 weight, its bf16 rows)."""
        ids = ids if ids.dtype == torch.int64 else ids.long()
        if self.fp32 is not None:
            if bool(((ids < 0) | (ids >= self.out_features)).any()):
                raise ValueError(f"an embedding id is outside the vocabulary [0, {self.out_features})")
            return self.fp32[ids // 16, :, ids % 16].float()  # bf16 panels (stands_alone): exact
        if self.dense is not None:
            out = torch.empty(ids.shape[0], self.dense.shape[1] * 2, dtype=torch.bfloat16)
            cpu_kernels.load().embedding_dense_bf16(out, ids, self.dense, self.out_features)
            return out
        if self.codes.dtype != torch.int8:
            raise ValueError("embedding rows are read from int8 codes; this weight was packed as nibbles")
        out = torch.empty(ids.shape[0], self.codes.shape[1], dtype=torch.float32)
        cpu_kernels.load().embedding_q8(out, ids, self.codes, self.scales, self.mins, self.out_features)
        return out

    @property
    def stands_alone(self) -> bool:
        """Whether these panels run every batch size, so the weight's fp32 [out, in] copy can go: codes
        (cpu_gemm.cpp takes large batches) or bf16 panels (widened once per block of rows)."""
        return self.codes is not None or (self.fp32 is not None and self.fp32.dtype == torch.bfloat16)

    @property
    def nbytes(self) -> int:
        parts = (self.fp32, self.codes, self.scales, self.mins, self.dense)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def nibble_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 code panels [P, K, 16] with every code in 0..15 -> uint8 [P, K / 2, 16], k = 2j in the low and
    k = 2j + 1 in the high 4 bits of row j: the kernels' nibble layout (half the bytes to read)."""
    pairs = codes.view(codes.shape[0], codes.shape[1] // 2, 2, codes.shape[2]).to(torch.uint8)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()


def codes_weight(
    weight: torch.Tensor, nibbles: bool = True, cache: CodesCache | None = None
) -> CpuPackedWeight | None:
    """An fp32 weight [out, in] as the kernel's integer-code panels, when integer blocks rebuild it
    exactly; None otherwise. Codes that all fit 0..15 (GGUF Q4_*) are stored two to a byte where
    `nibbles` (not for a tied embedding, whose rows embedding_q8 reads one code per byte)."""
    found = find_weight_codes(weight.detach(), cache)
    if found is None:
        return None
    codes = to_panels(found.codes)
    if nibbles and bool(((codes >= 0) & (codes <= 15)).all()):
        codes = nibble_codes(codes)
    return CpuPackedWeight(weight.shape[0], codes=codes, scales=to_panels(found.scales), mins=to_panels(found.mins))


def bf16_codes_weight(
    weight: torch.Tensor, nibbles: bool = True, cache: CodesCache | None = None
) -> CpuPackedWeight | None:
    """codes_weight for a model cast to bf16 next. Where its rows run on the bf16 kernels (AVX-512 BF16:
    dot and AMX), the scales and mins are kept as fp16 when every one is an fp16 value, as GGUF stores
    them: 0.625 bytes per Q4 weight instead of 0.75, the same results bit for bit."""
    packed = codes_weight(weight, nibbles, cache)
    if packed is not None and bf16_dot_supported():
        scales, mins = packed.scales.half(), packed.mins.half()
        if torch.equal(scales.float(), packed.scales) and torch.equal(mins.float(), packed.mins):
            packed.scales, packed.mins = scales, mins
    return packed


def dense_bf16_weight(weight: torch.Tensor) -> CpuPackedWeight:
    """A bf16 weight [out, in] in the dense bf16 kernel's panels (cpu_dense_bf16.cpp)."""
    return CpuPackedWeight(weight.shape[0], dense=cpu_kernels.load().pack_bf16_weight(weight.detach()))


def pack_cpu_weight(
    weight: torch.Tensor, blocks: bool | None = None, nibbles: bool = True, cache: CodesCache | None = None
) -> CpuPackedWeight:
    """Pack an fp32 weight [out, in] for the fp32 CPU kernel: as integer blocks when they rebuild it
    exactly (and `blocks`, by default unless TOKENMILL_CPU_LINEAR=fp32), else as fp32 panels, stored as
    bf16 where every value is a bf16 value (half the bytes a decode step reads, the same sums)."""
    weight = weight.detach()
    if blocks is None:
        blocks = cpu_linear_mode() == "1"
    packed = codes_weight(weight, nibbles, cache) if blocks else None
    if packed is not None:
        return packed
    return CpuPackedWeight(weight.shape[0], fp32=cpu_kernels.load().pack_linear_weight(weight, True))


class Linear(nn.Linear):
    """nn.Linear whose weight can be swapped for a packed copy after loading: oneDNN's blocked layout
    for bf16, or the fp32 AVX2 kernel's panels.

    Unpacked, oneDNN re-lays-out the whole weight on every bf16 call; for the small batches of a
    decode step that costs as much as the product itself. torch's fp32 GEMM on AVX2 ran 8 rows at a
    quarter of one row's bandwidth (docs/benchmark-log.md); the packed kernel reads each weight once per
    step, from int8 codes where the weight has them.
    """

    packed: torch.Tensor | None = None
    packed_cpu: CpuPackedWeight | None = None
    bias_fp32: torch.Tensor | None = None  # a bf16 model's bias for the codes kernel (attach_codes)

    def prepack(self) -> None:
        """oneDNN's bf16 layout. A weight that also has integer codes (attach_codes) runs single rows
        from them, so its unpacked bf16 copy, which only single rows read, is dropped; where the codes
        run every batch (bf16_codes_max_rows) it keeps no oneDNN copy either."""
        if self.weight is None:  # loaded as codes (model/gguf_weights.py): they run every batch
            return
        if self.packed_cpu is not None and bf16_codes_max_rows() >= 1 << 62:  # codes run every batch here
            self.weight = None
            return
        self.packed = prepack_weight(self.weight)
        if self.packed_cpu is not None:
            self.weight = None

    def pack_dense(self) -> None:
        """The dense bf16 kernel's panels for this bf16 weight (one without codes), with the fp32 bias the
        kernel adds. Where that kernel takes every batch (dense_bf16_max_rows) the weight keeps no other
        copy; else oneDNN's packed copy serves the larger batches."""
        self.packed_cpu = dense_bf16_weight(self.weight)
        self.bias_fp32 = None if self.bias is None else self.bias.detach().float().clone()
        if dense_bf16_max_rows() < 1 << 62:
            self.packed = prepack_weight(self.weight)
        self.weight = None

    def attach_codes(self, cache: CodesCache | None = None, weight: torch.Tensor | None = None) -> bool:
        """Keep the integer-code form of this fp32 weight, if it has one, for a model cast to bf16 next
        (with the fp32 bias the kernel adds). weight: the fp32 value while a bf16 model streams in
        (model/loader.py; the bias then comes through keep_fp32_bias). False: the weight is still needed."""
        self.packed_cpu = bf16_codes_weight(self.weight if weight is None else weight, cache=cache)
        if weight is None:
            self.bias_fp32 = None if self.bias is None else self.bias.detach().float().clone()
        return False

    def keep_fp32_bias(self, bias: torch.Tensor) -> bool:
        """attach_codes' fp32 bias, from its value while a bf16 model streams in."""
        self.bias_fp32 = bias.detach().clone()
        return False

    def pack_cpu(
        self, blocks: bool | None = None, keep_fp32: bool = False, cache: CodesCache | None = None
    ) -> bool:
        """Pack for the fp32 CPU kernel. A weight found as integer blocks or bf16 panels then runs every
        batch from them and its [out, in] fp32 copy is dropped (unless keep_fp32); an fp32-panel weight
        keeps it, for batches over CPU_PACKED_MAX_ROWS rows, which run faster through torch's GEMM.
        Whether the fp32 weight was dropped."""
        if self.weight is None:  # loaded as codes (model/gguf_weights.py, int4_weights.py)
            return True
        self.packed_cpu = pack_cpu_weight(self.weight, blocks, cache=cache)
        if self.packed_cpu.stands_alone and not keep_fp32:
            self.weight = None
            return True
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed_cpu = self.packed_cpu
        if packed_cpu is not None:
            rows = x.numel() // x.shape[-1]
            if x.dtype == torch.bfloat16:
                if getattr(packed_cpu, "dense", None) is not None:  # dense bf16 panels
                    if rows <= dense_bf16_max_rows() or self.packed is None:
                        return packed_cpu.linear(x, self.bias_fp32)
                elif rows <= bf16_codes_max_rows() or (self.packed is None and self.weight is None):
                    return packed_cpu.linear(x, self.bias_fp32)
            elif self.weight is None or rows <= CPU_PACKED_MAX_ROWS:  # fp32
                return packed_cpu.linear(x, self.bias)
        if self.packed is not None and (x.shape[0] >= PREPACK_MIN_ROWS or self.weight is None):
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


