"""LoRA slot memory: the bytes one rank holds for `max_loras` adapter slots of rank `max_lora_rank`, and the
fused layout behind it. Dependency-free: the operator's sizing and the engine's plan both call
`lora_slot_bytes`, so the KV budget they report leaves out the same bytes.

Layout (engine/layers/lora.py): each fused projection of each layer keeps, for every slot, the A matrices
of its parts stacked along the rank ([parts x R, in]) and one B that is block-diagonal over the parts
([out, parts x R]), so one grouped product per projection serves all its parts. Ranks below R are padded
with zeros.
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
) -> dict[str, tuple[int, int, int]]:
    """Fused projection -> (parts, in features, out features) on one rank."""
    tp = tensor_parallel
    q = num_attention_heads // tp * head_dim
    kv = kv_heads_per_rank(num_kv_heads, tp) * head_dim
    inter = intermediate_size // tp
    return {
        "qkv_proj": (3, hidden_size, q + 2 * kv),
        "o_proj": (1, q, hidden_size),
        "gate_up_proj": (2, hidden_size, 2 * inter),
        "down_proj": (1, inter, hidden_size),
    }


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
    """Bytes of all adapter slots on one rank (its stage's layers, its shard): A [parts x R, in] and
    B [out, parts x R] per fused projection, layer and slot."""
    shapes = lora_shapes(hidden_size, num_attention_heads, num_kv_heads, head_dim, intermediate_size,
                         tensor_parallel)  # fmt: skip
    per_layer = sum(parts * max_lora_rank * (fan_in + fan_out) for parts, fan_in, fan_out in shapes.values())
    layers = layers_per_stage(num_layers, pipeline_parallel)
    return max_loras * layers * per_layer * dtype_bytes(dtype)



def lora_scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's scale of B @ A: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
