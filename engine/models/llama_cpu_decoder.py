"""A step's decoder layers after the first in one C++ call (kernels/csrc/cpu_decoder.cpp), for bf16
models on the CPU whose projections run from their integer codes or from dense bf16 panels, and for fp32
models (CPUs without AVX-512 BF16) whose projections run from integer codes or the fp32 kernel's panels.

Why: at batch 1 Python's share of the bundled model's forward was 5.97 of 20.4 ms (every kernel replaced by
a no-op; docs/benchmark-log.md): ~300 op calls a step, each a module call, an allocation and the
dispatcher's parsing. The C++ loop runs the same kernels in the same order, so tokens and logits are the
Python path's bit for bit. The first layer stays in Python: it validates the attention arguments and
decides whether the step fits the C++ attention kernel (attention.py's cpu_direct), which this path needs.
TOKENMILL_FUSED_LAYERS=0 turns it off (A/B runs).
"""

import functools
import os
from dataclasses import dataclass

import torch
from tokenmill.engine.layers.attention import AttentionMetadata
from tokenmill.engine.layers.cpu_gemm_policy import (
    AMX_MIN_ROWS,
    CPU_PACKED_MAX_ROWS,
    amx_codes_supported,
    amx_dequant_min_rows,
    bf16_codes_dense_min_rows,
    bf16_codes_max_rows,
    bf16_dot_supported,
    bf16_gemm_min_rows,
    dense_bf16_max_rows,
)
from tokenmill.engine.layers.linear import CpuPackedWeight, Linear
from tokenmill.engine.layers.rotary_embedding import Rope
from tokenmill.kernels import cpu as cpu_kernels

_NEVER = 1 << 62  # a row threshold no batch reaches


@functools.cache
def fused_layers_enabled(dtype: torch.dtype) -> bool:
    """Whether the C++ layer loop may run steps of `dtype` rows (TOKENMILL_FUSED_LAYERS=0: never; read once
    per process): fp32 wherever the packed fp32 kernels build, bf16 only with the AVX-512 BF16 dot kernels."""
    if os.environ.get("TOKENMILL_FUSED_LAYERS", "1") == "0" or dtype not in (torch.bfloat16, torch.float32):
        return False
    ops = cpu_kernels.load()
    if ops is None or not hasattr(ops, "decoder_layers") or not ops.packed_linear_supported():
        return False
    return dtype == torch.float32 or bf16_dot_supported()


@dataclass(frozen=True, slots=True)
class FusedLayers:
    weights: list[torch.Tensor]  # cpu_decoder.cpp's flat list, 20 tensors per layer
    max_rows: int  # the most rows a step may have: every projection's kernel takes them
    int8_x: bool = False  # rows on codes round x to int8 (CpuPackedWeight.int8_x, set on every codes weight)


def _linear_parts(lin: Linear, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """codes, scales, mins, bias of a projection on codes; for one on dense bf16 panels (bf16 rows) or the
    fp32 kernel's panels (fp32 rows) the panels in the codes' place (cpu_decoder.cpp tells them apart by
    the rows' dtype and the panels' own) and empty scales and mins."""
    packed = lin.packed_cpu
    if dtype == torch.float32:  # Linear.forward's fp32 branch: CpuPackedWeight.linear with the fp32 bias
        # Split parts (a GGUF's q|k|v in two layouts) and grouped codes have kernels the loop does not call.
        if not isinstance(packed, CpuPackedWeight) or (packed.codes is None and packed.fp32 is None):
            return None
        bias = lin.bias if lin.bias is not None else torch.empty(0)
        if packed.codes is None:
            return [packed.fp32, torch.empty(0), torch.empty(0), bias]
        return [packed.codes, packed.scales, packed.mins, bias]
    dense = getattr(packed, "dense", None)
    if dense is None and getattr(packed, "codes", None) is None:  # none, fp32 panels, or another layout (grouped_codes.py)
        return None
    bias = lin.bias_fp32 if lin.bias_fp32 is not None else torch.empty(0)
    if dense is not None:
        return [dense, torch.empty(0), torch.empty(0), bias]
    return [packed.codes, packed.scales, packed.mins, bias]


def _linear_max_rows(lin: Linear, dtype: torch.dtype) -> int:
    if dtype == torch.float32:  # past CPU_PACKED_MAX_ROWS Linear.forward takes torch's linear on a kept weight
        return _NEVER if lin.weight is None else CPU_PACKED_MAX_ROWS
    return dense_bf16_max_rows() if getattr(lin.packed_cpu, "dense", None) is not None else bf16_codes_max_rows()


def layer_weights(
    layers: list, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> FusedLayers | None:
    """cpu_decoder.cpp's flat list for these layers (20 tensors each) and the rows it takes, or None when
    some layer cannot run there (q/k norms, a projection without the CPU kernels' weights for `dtype`,
    norm weights not in `dtype`); the caller checked fused_layers_enabled(dtype)."""
    flat: list[torch.Tensor] = []
    max_rows = 1 << 62
    int8_x = False
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if attn.qk_norm or any(w.dtype != dtype for w in norms):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        parts = [_linear_parts(lin, dtype) for lin in linears]
        if any(p is None for p in parts):
            return None
        flat += [n.detach() for n in norms] + [t for p in parts for t in p] + [k_cache, v_cache]
        max_rows = min([max_rows] + [_linear_max_rows(lin, dtype) for lin in linears])
        int8_x |= any(getattr(lin.packed_cpu, "int8_x", False) for lin in linears)
    return FusedLayers(flat, max_rows, int8_x)


def run_layers(
    layer: object,
    weights: list[torch.Tensor],
    hidden: torch.Tensor,
    residual: torch.Tensor,
    rope: Rope,
    md: AttentionMetadata,
    int8_x: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers `weights` were built from over hidden and residual: (hidden, residual) after them. `layer`
    is one of them, for the shapes all share (not a slice of the ModuleList: that builds a new one).
    int8_x: FusedLayers.int8_x."""
    attn = layer.self_attn
    _store, _attend, max_rows, max_pairs = md.cpu_direct
    sizes = [
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.q_size + 2 * attn.kv_size,
        layer.mlp.down_proj.in_features,
        max_rows,
        max_pairs,
        AMX_MIN_ROWS if amx_codes_supported() else _NEVER,
        amx_dequant_min_rows(),
        bf16_gemm_min_rows(),
        CPU_PACKED_MAX_ROWS,
        int(int8_x),
        bf16_codes_dense_min_rows(),
    ]
    return cpu_kernels.load().decoder_layers(
        hidden,
        residual,
        weights,
        rope.positions,
        rope.cos,
        rope.sin,
        md.slot_mapping,
        md.block_tables,
        md.query_start_loc,
        md.seq_lens,
        attn.scale,
        layer.input_layernorm.eps,
        sizes,
    )


def step_fits(hidden: torch.Tensor, rope: Rope, md: AttentionMetadata) -> bool:
    """Whether this step's remaining layers can take the C++ loop: bf16 or fp32 rows, the full rotary tables,
    and attention the first layer cleared for the C++ kernel (the rows' limit is FusedLayers.max_rows)."""
    return (
        hidden.dtype in (torch.bfloat16, torch.float32)
        and hidden.device.type == "cpu"
        and not rope.gathered
        and md.cpu_direct is not None
    )
