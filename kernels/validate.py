"""Cheap argument checks shared by every kernel implementation.

They run for every layer of every step, so they look only at shapes, dtypes and devices (tensor
metadata, no device sync). The one value check, seq_lens against block-table capacity, reads
seq_lens only when it lives on the CPU; for device tensors the caller (the engine builds its
metadata on the CPU first) calls check_seq_lens_fit itself.
"""

import torch
from tokenmill.kernels import kv_quant

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {_shape(k_cache)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {_shape(k_cache)}, got {_shape(v_cache)}")
    if k_cache.dtype not in _FLOAT_DTYPES and not kv_quant.is_quantized(k_cache):
        raise ValueError(
            "k_cache dtype must be one of float32/float16/bfloat16 or (8-bit) int8/float8_e4m3fn/float8_e5m2, "
            f"got {k_cache.dtype}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype must equal k_cache dtype {k_cache.dtype}, got {v_cache.dtype}")
    if kv_quant.is_quantized(k_cache) and (k_cache.shape[3] <= kv_quant.KV_SCALE_BYTES or k_cache.shape[3] % 4):
        raise ValueError(
            f"an 8-bit cache is [num_blocks, block_size, num_kv_heads, head_dim + {kv_quant.KV_SCALE_BYTES}] "
            f"(codes, then an fp32 scale) with head_dim a multiple of 4, got {_shape(k_cache)}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache must be on k_cache's device {k_cache.device}, got {v_cache.device}")
    # Every implementation addresses slots as flat offsets into the cache.
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            "k_cache and v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]"
        )


def _check_dtype(name: str, t: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Queries, keys and values are the model's dtype: the cache's, or any float one for an 8-bit cache."""
    if kv_quant.is_quantized(k_cache):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be float32/float16/bfloat16, got {t.dtype}")
    elif t.dtype != k_cache.dtype:
        raise ValueError(f"{name} dtype must equal the cache dtype {k_cache.dtype}, got {t.dtype}")


def _check_same(name: str, t: torch.Tensor, ref: torch.Tensor, what: str = "k_cache") -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {what}'s device {ref.device}, got {t.device}")


def _check_int(name: str, t: torch.Tensor, dtype: torch.dtype, shape: str, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {dtype} {shape}, got shape {_shape(t)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {shape}, got dtype {t.dtype}")


def check_store_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_cache(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], kv_quant.cache_head_dim(k_cache)
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], got {_shape(key)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {_shape(key)}, got {_shape(value)}")
    for name, t in (("key", key), ("value", value)):
        _check_dtype(name, t, k_cache)
        _check_same(name, t, k_cache)
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype must equal key dtype {key.dtype}, got {value.dtype}")
    _check_int("slot_mapping", slot_mapping, torch.int64, "[num_tokens]", 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be [num_tokens={key.shape[0]}] (one slot per key row), "
            f"got {_shape(slot_mapping)}"
        )
    _check_same("slot_mapping", slot_mapping, k_cache)


def _check_query(q: torch.Tensor, k_cache: torch.Tensor, rows: str) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], kv_quant.cache_head_dim(k_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0 or q.shape[1] == 0:
        rows_8bit = f" (an 8-bit cache's rows are head_dim + {kv_quant.KV_SCALE_BYTES}: codes, then an fp32 scale)"
        raise ValueError(
            f"q must be [{rows}, num_heads (a multiple of num_kv_heads={num_kv_heads}), "
            f"head_dim={head_dim}], got {_shape(q)}{rows_8bit if kv_quant.is_quantized(k_cache) else ''}"
        )
    _check_dtype("q", q, k_cache)
    _check_same("q", q, k_cache)


def _check_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int, k_cache: torch.Tensor
) -> None:
    _check_int("block_tables", block_tables, torch.int32, "[num_seqs, max_blocks_per_seq]", 2)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got {_shape(block_tables)}"
        )
    _check_int("seq_lens", seq_lens, torch.int32, "[num_seqs]", 1)
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {_shape(seq_lens)}")
    _check_same("block_tables", block_tables, k_cache)
    _check_same("seq_lens", seq_lens, k_cache)
    if seq_lens.device.type == "cpu":
        check_seq_lens_fit(seq_lens, block_tables.shape[1], k_cache.shape[1])


def check_seq_lens_fit(seq_lens: torch.Tensor, max_blocks_per_seq: int, block_size: int) -> None:
    """Raise if any sequence is longer than its block-table row can address (or negative).

    Reads seq_lens, so on a device tensor this syncs: call it on the CPU copy.
    """
    if seq_lens.numel() == 0:
        return
    capacity = max_blocks_per_seq * block_size
    shortest, longest = (int(x) for x in torch.aminmax(seq_lens))
    if longest > capacity:
        i = int(seq_lens.argmax())
        raise ValueError(
            f"seq_lens[{i}]={longest} exceeds what block_tables can hold: "
            f"max_blocks_per_seq={max_blocks_per_seq} x block_size={block_size} = {capacity} tokens"
        )
    if shortest < 0:
        raise ValueError(f"seq_lens must be >= 0, got {shortest}")


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    _check_cache(k_cache, v_cache)
    _check_query(q, k_cache, "num_seqs")
    _check_tables(block_tables, seq_lens, q.shape[0], k_cache)


def check_prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    _check_cache(k_cache, v_cache)
    _check_query(q, k_cache, "num_tokens")
    _check_int("query_start_loc", query_start_loc, torch.int32, "[num_seqs + 1]", 1)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must be [num_seqs + 1], got an empty tensor")
    _check_same("query_start_loc", query_start_loc, k_cache)
    _check_tables(block_tables, seq_lens, num_seqs, k_cache)
    if query_start_loc.device.type == "cpu":
        _check_query_lens(query_start_loc, seq_lens, q.shape[0])


def _check_query_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> None:
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc must run from 0 to num_tokens={num_tokens}, "
            f"got {int(query_start_loc[0])}..{int(query_start_loc[-1])}"
        )
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_lens.numel() == 0:
        return
    if int(query_lens.min()) < 0:
        raise ValueError("query_start_loc must be non-decreasing")
    too_long = query_lens > seq_lens
    if bool(too_long.any()):
        i = int(too_long.nonzero()[0, 0])
        raise ValueError(
            f"sequence {i} has {int(query_lens[i])} query tokens but seq_lens[{i}]={int(seq_lens[i])}: "
            "seq_lens counts the cached prefix plus this chunk, so it must be >= the chunk length"
        )
