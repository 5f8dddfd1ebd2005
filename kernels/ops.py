"""The public kernel entry points: validate, then dispatch to Triton (CUDA) or the torch reference.

The Triton modules are imported on first use, not here: `@triton.jit` decides at import time
whether to run through the interpreter (TRITON_INTERPRET=1), and CPU-only users never need Triton.
"""

import os

import torch
from tokenmill.kernels import reference
from tokenmill.kernels.validate import check_decode_args, check_prefill_args, check_store_kv_args

IMPLS = ("auto", "triton", "torch")


def _use_triton(impl: str, device: torch.device) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":
        return device.type == "cuda"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"impl='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 (set before Triton is imported)"
        )
    return True


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """Write K/V rows [num_tokens, num_kv_heads, head_dim] into cache slots (slot -1 skips the row)."""
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    if _use_triton(impl, k_cache.device):
        from tokenmill.kernels.triton_store_kv import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """One query token per sequence: q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]."""
    check_decode_args(q, k_cache, v_cache, block_tables, seq_lens)
    if _use_triton(impl, q.device):
        from tokenmill.kernels.triton_decode import paged_attention_decode_triton

        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return reference.paged_attention_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Causal attention for variable-length query chunks over each sequence's cached prefix and itself."""
    check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    if _use_triton(impl, q.device):
        from tokenmill.kernels.triton_prefill import paged_attention_prefill_triton

        return paged_attention_prefill_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
        )
    return reference.paged_attention_prefill_torch(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
    )
