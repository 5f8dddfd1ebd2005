"""The public kernel entry points: validate, then dispatch to Triton (CUDA), the C++ CPU kernel or the
torch reference.

The Triton modules are imported on first use, not here: `@triton.jit` decides at import time
whether to run through the interpreter (TRITON_INTERPRET=1), and CPU-only users never need Triton.
On a CPU, "auto" takes the C++ kernel (kernels/csrc, built on first use, see kernels/cpu.py) and falls
back to the torch reference when it cannot be built or TOKENMILL_CPU_KERNELS=0.
"""

import os

import torch
from tokenmill.kernels import cpu, kv_quant, reference
from tokenmill.kernels.validate import check_decode_args, check_prefill_args, check_store_kv_args

IMPLS = ("auto", "triton", "cpu", "torch")
# A sequence's chunk goes through the C++ kernel (row tiles walking the paged cache) up to this many
# (query row, key) pairs, rows * (seq_len - rows // 2); more goes to the reference, whose SDPA call turns
# it into matrix products. Measured on AVX2 (fp32, SmolLM2's heads, one thread): a 384-token prompt
# 11.6 ms C++ vs 24.0 torch (74k pairs), a 512-token prompt 29.9 vs 28.9 (131k), 64 rows after 3,000
# cached 47.3 vs 39.4 (194k): the crossover is near 128k pairs.
CPU_MAX_ATTN_PAIRS = 1 << 17
# Half-precision chunks over this many rows keep the reference: its SDPA rounds like transformers' own
# (bit for bit in tests/test_model_llama.py), where the kernel's fp32 softmax moved a tiny random
# model's bf16 argmax agreement with fp32 from 0.875 to 0.80 on a 40-token prompt.
CPU_MAX_QUERY_LEN_HALF = 32
_NO_LIMIT = 1 << 62


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
        return
    ops = _cpu_ops(impl, k_cache.device)
    if (
        ops is not None
        and hasattr(ops, "store_kv")
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and (key.dtype == k_cache.dtype or kv_quant.is_quantized(k_cache))
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    ):
        # One C++ op per layer (cpu_attention.cpp), as the engine's decode steps already call it: the
        # reference's compare, all() and two index_copy_ calls cost 1 ms per layer for a 2,048-token step.
        ops.store_kv(k_cache, v_cache, key, value, slot_mapping)  # type: ignore[attr-defined]
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
        ops.paged_attention_varlen(
            out, q, k_cache, v_cache, block_tables, _arange(q.shape[0] + 1), seq_lens, scale, 1, _NO_LIMIT
        )
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


def _max_query_len(dtype: torch.dtype) -> int:
    return _NO_LIMIT if dtype == torch.float32 else CPU_MAX_QUERY_LEN_HALF


def too_big_for_cpu_kernel(rows: int, seq_len: int, dtype: torch.dtype = torch.float32) -> bool:
    """The C++ kernel's skip rule (cpu_attention.cpp): such a chunk goes to the matmul-based reference."""
    return rows > 0 and (rows > _max_query_len(dtype) or rows * (seq_len - rows // 2) > CPU_MAX_ATTN_PAIRS)


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
    """Decode rows and prompt chunks up to CPU_MAX_ATTN_PAIRS in the C++ kernel; bigger ones through the
    reference (the same rule as the kernel's skip)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    long = [i for i, n in enumerate(lens) if too_big_for_cpu_kernel(starts[i + 1] - starts[i], n, q.dtype)]
    if len(long) == len(lens):  # all of them (a step of long prompts): the kernel would skip every one
        return reference.paged_attention_prefill_torch(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
        )
    out = q.new_empty(q.shape)
    max_rows = _max_query_len(q.dtype)
    ops.paged_attention_varlen(  # type: ignore[attr-defined]
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_rows, CPU_MAX_ATTN_PAIRS
    )
    if not long:
        return out
    sub_starts = [0]
    for i in long:
        sub_starts.append(sub_starts[-1] + starts[i + 1] - starts[i])
    idx = torch.tensor(long)
    args = (k_cache, v_cache, block_tables[idx], torch.tensor(sub_starts, dtype=torch.int32), seq_lens[idx], scale)
    if long == list(range(long[0], long[-1] + 1)):
        # One run of sequences (the scheduler's usual mixed step: decode rows, then the prompt chunks):
        # a view of q in and a slice of out back, no gather and scatter of their rows.
        first, last = starts[long[0]], starts[long[-1] + 1]
        out[first:last] = reference.paged_attention_prefill_torch(q[first:last], *args)
        return out
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in long])
    # index_select / index_copy_: advanced indexing (q[rows], out[rows] = ...) took 5-10x longer.
    out.index_copy_(0, rows, reference.paged_attention_prefill_torch(q.index_select(0, rows), *args))
    return out
