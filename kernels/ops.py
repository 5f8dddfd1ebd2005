"""The public kernel entry points: validate, then dispatch to Triton (CUDA), the C++ CPU kernel or the
torch reference.

The Triton modules are imported on first use, not here: `@triton.jit` decides at import time
whether to run through the interpreter (TRITON_INTERPRET=1), and CPU-only users never need Triton.
On a CPU, "auto" takes the C++ kernel (kernels/csrc, built on first use, see kernels/cpu.py) and falls
back to the torch reference when it cannot be built or TOKENMILL_CPU_KERNELS=0.
"""

import os

import torch
from tokenmill.kernels import cpu, reference
from tokenmill.kernels.validate import check_decode_args, check_prefill_args, check_store_kv_args

IMPLS = ("auto", "triton", "cpu", "torch")
# Query chunks up to this many rows go through the C++ kernel (one pass over the cache per row); longer
# prompt chunks go to the reference, whose SDPA call turns them into matrix products.
CPU_MAX_QUERY_LEN = 32


def _use_triton(impl: str, device: torch.device) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl in ("torch", "cpu"):
        return False
    if impl == "auto":
        return device.type == "cuda"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"impl='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 (set before Triton is imported)"
        )
    return True


def _cpu_ops(impl: str, device: torch.device) -> object | None:
    """The C++ op namespace when this call should use it, else None (then: the torch reference)."""
    if impl == "cpu":
        if device.type != "cpu":
            raise ValueError(f"impl='cpu' needs CPU tensors, got {device.type}")
        ops = cpu.load()
        if ops is None:
            raise ValueError(f"impl='cpu': the C++ CPU kernels are unavailable ({cpu.unavailable_reason()})")
        return ops
    if impl == "auto" and device.type == "cpu":
        return cpu.load()
    return None


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    impl: str = "auto",
    validate: bool = True,
) -> None:
    """Write K/V rows [num_tokens, num_kv_heads, head_dim] into cache slots (slot -1 skips the row).

    validate=False skips the argument checks: for a caller that checked the same step's metadata once
    already (the engine calls this for every layer with tensors of the same shapes).
    """
    if validate:
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
    validate: bool = True,
) -> torch.Tensor:
    """One query token per sequence: q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]."""
    if validate:
        check_decode_args(q, k_cache, v_cache, block_tables, seq_lens)
    if _use_triton(impl, q.device):
        from tokenmill.kernels.triton_decode import paged_attention_decode_triton

        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    ops = _cpu_ops(impl, q.device)
    if ops is not None:
        out = q.new_empty(q.shape)
        ops.paged_attention_varlen(out, q, k_cache, v_cache, block_tables, _arange(q.shape[0] + 1), seq_lens, scale, 1)
        return out
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
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention for variable-length query chunks over each sequence's cached prefix and itself."""
    if validate:
        check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    if _use_triton(impl, q.device):
        from tokenmill.kernels.triton_prefill import paged_attention_prefill_triton

        return paged_attention_prefill_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
        )
    ops = _cpu_ops(impl, q.device)
    if ops is not None:
        return _prefill_cpu(ops, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    return reference.paged_attention_prefill_torch(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
    )


_ARANGES: dict[int, torch.Tensor] = {}


def _arange(n: int) -> torch.Tensor:
    """int32 0..n-1 (decode's query_start_loc), kept: the engine asks for the same few sizes every layer."""
    t = _ARANGES.get(n)
    if t is None:
        t = _ARANGES[n] = torch.arange(n, dtype=torch.int32)
    return t


def _prefill_cpu(
    ops: object,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Short chunks (decode rows, small prompts) in the C++ kernel; long ones through the reference."""
    out = q.new_empty(q.shape)
    ops.paged_attention_varlen(  # type: ignore[attr-defined]
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, CPU_MAX_QUERY_LEN
    )
    starts = query_start_loc.tolist()
    long = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > CPU_MAX_QUERY_LEN]
    if not long:
        return out
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in long])
    sub_starts = [0]
    for i in long:
        sub_starts.append(sub_starts[-1] + starts[i + 1] - starts[i])
    idx = torch.tensor(long)
    out[rows] = reference.paged_attention_prefill_torch(
        q[rows], k_cache, v_cache, block_tables[idx], torch.tensor(sub_starts, dtype=torch.int32),
        seq_lens[idx], scale,
    )
    return out
