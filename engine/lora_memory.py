"""LoRA slot memory: the bytes one rank holds for `max_loras` adapter slots of rank `max_lora_rank`, and the
fused layout behind it. Dependency-free: the operator's sizing and the engine's plan both call
`lora_slot_bytes`, so the KV budget they report leaves out the same bytes.

Layout (engine/layers/lora.py): each fused projection of each layer keeps, for every slot, the A matrices
of its parts side by side along the rank ([in, parts x R]: one shrink product serves all parts) and each
part's B ([R, part's out]). Ranks below R are padded with zeros.
"""

import math

from tokenmill.engine.kv_memory import dtype_bytes, kv_heads_per_rank, layers_per_stage

# Fused projection (models/llama.py) -> the PEFT target modules it is made of, in its row order.
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
LORA_TARGET_MODULES: tuple[str, ...] = tuple(t for parts in FUSED_TARGETS.values() for t in parts)
# Row parallel under tensor parallelism: their A is split by input columns like the base weight (the
# all-reduce after them sums the partial products); the others split B by output rows.
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def lora_shapes(
    hidden_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    tensor_parallel: int = 1,
) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Fused projection -> (in features, each part's out features) on one rank."""
    tp = tensor_parallel
    q = num_attention_heads // tp * head_dim
    kv = kv_heads_per_rank(num_kv_heads, tp) * head_dim
    inter = intermediate_size // tp
    return {
        "qkv_proj": (hidden_size, (q, kv, kv)),
        "o_proj": (q, (hidden_size,)),
        "gate_up_proj": (hidden_size, (inter, inter)),
        "down_proj": (inter, (hidden_size,)),
    }


def lora_dtype(device_type: str, dtype: str) -> str:
    """The slots' dtype: the model's, except fp32 on CPU (engine/layers/lora.py says why)."""
    return "float32" if device_type == "cpu" else dtype


def lora_slot_bytes(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_loras: int,
    max_lora_rank: int,
    dtype: str,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """Bytes of all adapter slots on one rank (its stage's layers, its shard): A [in, parts x R] and each
    part's B [R, out] per fused projection, layer and slot."""
    shapes = lora_shapes(hidden_size, num_attention_heads, num_kv_heads, head_dim, intermediate_size,
                         tensor_parallel)  # fmt: skip
    per_layer = sum(max_lora_rank * (len(outs) * fan_in + sum(outs)) for fan_in, outs in shapes.values())
    layers = layers_per_stage(num_layers, pipeline_parallel)
    return max_loras * layers * per_layer * dtype_bytes(dtype)



def lora_scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's scale of B @ A: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
