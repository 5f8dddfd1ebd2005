"""KV-cache memory math shared by the engine and the operator's sizing.

Dependency-free on purpose (no torch): the operator image imports it. Every number about KV bytes,
blocks and concurrency is computed here and nowhere else.
"""

import math

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", "float16")."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {sorted(DTYPE_BYTES)}") from None


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, tensor_parallel: int = 1
) -> int:
    """K and V for every layer, for one token, on one GPU of a tensor-parallel group.

    Each rank holds num_kv_heads / TP heads; when TP exceeds the KV heads they are replicated, so a
    rank never holds less than one head.
    """
    heads_per_rank = max(1, math.ceil(num_kv_heads / tensor_parallel))
    return 2 * num_layers * heads_per_rank * head_dim * dtype_bytes(dtype)


def kv_bytes_per_block(kv_bytes_token: int, block_size: int) -> int:
    return kv_bytes_token * block_size


def num_kv_blocks(budget_bytes: float, block_size: int, kv_bytes_token: int) -> int:
    """How many whole blocks fit in a byte budget (0 when the budget is negative)."""
    if budget_bytes <= 0:
        return 0
    return int(budget_bytes // kv_bytes_per_block(kv_bytes_token, block_size))


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def align_down(value: int, multiple: int) -> int:
    return (value // multiple) * multiple


def max_concurrency(kv_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many sequences of max_model_len tokens fit in the pool at once."""
    if max_model_len <= 0:
        return 0.0
    return kv_blocks / blocks_for_tokens(max_model_len, block_size)
