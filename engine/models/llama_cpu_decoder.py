"""A step's decoder layers after the first in one C++ call (kernels/csrc/cpu_decoder.cpp), for bf16
models on the CPU whose projections run from their integer codes.

Why: at batch 1 Python's share of the bundled model's forward was 5.97 of 20.4 ms (every kernel replaced by
a no-op; docs/benchmark-log.md): ~300 op calls a step, each a module call, an allocation and the
dispatcher's parsing. The C++ loop runs the same kernels in the same order, so tokens and logits are the
Python path's bit for bit. The first layer stays in Python: it validates the attention arguments and
decides whether the step fits the C++ attention kernel (attention.py's cpu_direct), which this path needs.
TOKENMILL_FUSED_LAYERS=0 turns it off (A/B runs).
"""

import functools
import os

import torch
from tokenmill.engine.layers.attention import AttentionMetadata
from tokenmill.engine.layers.cpu_gemm_policy import (
    AMX_MIN_ROWS,
    amx_codes_supported,
    amx_dequant_min_rows,
    bf16_codes_max_rows,
    bf16_dot_supported,
)
from tokenmill.engine.layers.linear import Linear
from tokenmill.engine.layers.rotary_embedding import Rope
from tokenmill.kernels import cpu as cpu_kernels

_NEVER = 1 << 62  # a row threshold no batch reaches


@functools.cache
def fused_layers_enabled() -> bool:
    """Whether the C++ layer loop may run (TOKENMILL_FUSED_LAYERS=0: never; read once per process)."""
    if os.environ.get("TOKENMILL_FUSED_LAYERS", "1") == "0":
        return False
    ops = cpu_kernels.load()
    return ops is not None and hasattr(ops, "decoder_layers") and bf16_dot_supported()


def _linear_parts(lin: Linear) -> list[torch.Tensor] | None:
    packed = lin.packed_cpu
    if getattr(packed, "codes", None) is None:  # none, fp32 panels, or another layout (grouped_codes.py)
        return None
    bias = lin.bias_fp32 if lin.bias_fp32 is not None else torch.empty(0)
    return [packed.codes, packed.scales, packed.mins, bias]


def layer_weights(layers: list, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor] | None:
    """cpu_decoder.cpp's flat list for these layers (20 tensors each), or None when some layer cannot run
    there (q/k norms, a projection without codes, norm weights that are not bf16)."""
    flat: list[torch.Tensor] = []
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if attn.qk_norm or any(w.dtype != torch.bfloat16 for w in norms):
            return None
        parts = [_linear_parts(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in parts):
            return None
        flat += [n.detach() for n in norms] + [t for p in parts for t in p] + [k_cache, v_cache]
    return flat


def run_layers(
    layer: object,
    weights: list[torch.Tensor],
    hidden: torch.Tensor,
    residual: torch.Tensor,
    rope: Rope,
    md: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers `weights` were built from over hidden and residual: (hidden, residual) after them. `layer`
    is one of them, for the shapes all share (not a slice of the ModuleList: that builds a new one)."""
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
    """Whether this step's remaining layers can take the C++ loop: bf16 rows few enough for the codes
    kernels, the full rotary tables, and attention the first layer cleared for the C++ kernel."""
    return (
        hidden.dtype == torch.bfloat16
        and hidden.device.type == "cpu"
        and hidden.shape[0] <= bf16_codes_max_rows()
        and not rope.gathered
        and md.cpu_direct is not None
    )
