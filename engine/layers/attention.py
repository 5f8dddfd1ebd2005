"""Per-step attention metadata and the one attention path the models call."""

from dataclasses import dataclass
from typing import Any

import torch
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels import paged_attention_decode, paged_attention_prefill, store_kv
from tokenmill.kernels.ops import too_big_for_cpu_kernel

_NO_LIMIT = 1 << 62


@dataclass(slots=True)
class AttentionMetadata:
    """What every attention layer needs for one flattened step.

    The step's tokens are laid out sequence after sequence; sequence i owns query tokens
    query_start_loc[i]:query_start_loc[i+1] and has seq_lens[i] tokens in the cache once this step's
    tokens are written (cached prefix + this step's chunk).
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 skips the write
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    decode_only: bool  # every sequence contributes exactly one query token
    max_query_len: int
    max_seq_len: int
    # Set after the first layer validated the kernel arguments: every later layer of the step passes
    # tensors of the same shapes, dtypes and devices, so the checks (a dozen small ops) run once per step.
    validated: bool = False
    # Set by the first layer when the whole step fits the C++ CPU kernels (every sequence's chunk within
    # the kernel's skip rule): later layers then call the two C++ ops directly, without the dispatch,
    # the reference's slot checks and the per-layer list conversions in kernels/ops.py.
    cpu_direct: Any = None  # (store_kv, paged_attention_varlen, max_query_len, max_pairs) OpOverloads + limits


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend over each sequence's cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    """
    direct = md.cpu_direct
    if direct is not None:
        store, attend, max_rows, max_pairs = direct
        store(k_cache, v_cache, k, v, md.slot_mapping)
        out = q.new_empty(q.shape)
        attend(out, q, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, scale, max_rows, max_pairs)
        return out
    check = not md.validated
    store_kv(k, v, k_cache, v_cache, md.slot_mapping, validate=check)
    if md.decode_only:
        out = paged_attention_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale, validate=check)
    else:
        out = paged_attention_prefill(
            q, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, scale, validate=check
        )
    if check:
        md.cpu_direct = _cpu_direct(q, md)
    md.validated = True
    return out


def _cpu_direct(q: torch.Tensor, md: AttentionMetadata) -> tuple | None:
    """The C++ ops and limits for the rest of this step's layers, or None when some sequence needs the
    torch reference (a chunk too big for the kernel) or the kernels are off or unavailable."""
    if q.device.type != "cpu" or md.slot_mapping.device.type != "cpu":
        return None
    ops = cpu_kernels.load()
    if ops is None or not hasattr(ops, "store_kv"):
        return None
    starts = md.query_start_loc.tolist()
    lens = md.seq_lens.tolist()
    if any(too_big_for_cpu_kernel(starts[i + 1] - starts[i], n, q.dtype) for i, n in enumerate(lens)):
        return None
    # Every chunk is inside the skip rule, so the limits need only let every row through.
    return ops.store_kv.default, ops.paged_attention_varlen.default, _NO_LIMIT, _NO_LIMIT
