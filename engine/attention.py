"""Per-step attention metadata and the one attention path the models call."""

from dataclasses import dataclass

import torch
from tokenmill.kernels import paged_attention_decode, paged_attention_prefill, store_kv


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
    check = not md.validated
    store_kv(k, v, k_cache, v_cache, md.slot_mapping, validate=check)
    if md.decode_only:
        out = paged_attention_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale, validate=check)
    else:
        out = paged_attention_prefill(
            q, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, scale, validate=check
        )
    md.validated = True
    return out
