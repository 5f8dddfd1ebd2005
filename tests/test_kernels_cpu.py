"""The C++ CPU kernel (kernels/csrc/cpu_attention.cpp) against the float64 oracle and the torch reference.

The kernel is built on first use; these tests fail (not skip) when it cannot be built, because the
engine's CPU speed depends on it.
"""

import math

import pytest
import torch
from test_kernels_common import assert_close, decode_batch, naive_decode, naive_prefill, prefill_batch
from tokenmill.kernels import cpu, ops, paged_attention_decode, paged_attention_prefill

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_kernel_builds_here():
    assert cpu.load() is not None, f"C++ CPU kernels failed to build: {cpu.unavailable_reason()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: the portable (non-AVX-512) path
def test_decode_matches_naive(dtype, block_size, num_kv_heads, group, head_dim):
    bs = block_size
    lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 0, 17]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, bs, num_kv_heads, group, head_dim, dtype, seed=5)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale, impl="cpu")
    assert_close(out, naive_decode(q, k_cache, v_cache, table, seq_lens, scale), dtype)
    assert torch.count_nonzero(out[5]) == 0  # a zero-length row (batch padding) gives zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (1, 3), (1, 8)])
def test_prefill_matches_naive(dtype, block_size, num_kv_heads, group, monkeypatch):
    # A small pair limit (the split rule is the same at any limit) keeps the float64 oracle fast.
    monkeypatch.setattr(ops, "CPU_MAX_ATTN_PAIRS", 4000)
    bs = block_size
    # Short chunks, prompt chunks of tens of rows (the C++ kernel's row tiles, partial last tiles),
    # chunks over CPU_MAX_ATTN_PAIRS (sent to the reference in the same call: a long prompt, a short chunk
    # after a long cached prefix), chunks starting mid-block after a cached prefix, a decode row and an
    # idle sequence.
    seq_lens = [1, bs - 1, bs + 1, 98, bs + 7, 118, 2 * bs, 40, 73, 45, 150]
    query_lens = [1, bs - 1, bs + 1, 98, 3, 98, 1, 0, 70, 45, 40]
    sent_to_reference = [ops.too_big_for_cpu_kernel(n, s, dtype) for s, n in zip(seq_lens, query_lens, strict=True)]
    if dtype == torch.float32:
        assert sent_to_reference == [False] * 3 + [True, False, True] + [False] * 4 + [True]
    else:  # half precisions: also every chunk over CPU_MAX_QUERY_LEN_HALF rows
        assert sent_to_reference == [False, False, bs + 1 > 32, True, False, True, False, False, True, True, True]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, bs, num_kv_heads, group, 64, dtype)
    scale = 0.125
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, scale, impl="cpu")
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, scale), dtype)


def test_prefill_at_the_real_pair_limit_agrees_with_reference():
    """Chunks just under and just over CPU_MAX_ATTN_PAIRS as the engine meets them (fp32)."""
    rows = int((2 * ops.CPU_MAX_ATTN_PAIRS) ** 0.5)
    seq_lens, query_lens = [rows - 8, rows + 8, 3000], [rows - 8, rows + 8, 30]
    assert [ops.too_big_for_cpu_kernel(n, s) for s, n in zip(seq_lens, query_lens, strict=True)] == [
        False, True, False
    ]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, 16, 3, 3, 64, torch.float32)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, 0.125, impl="cpu")
    ref = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, 0.125, impl="torch")
    assert_close(out, ref.double(), torch.float32)


def test_strided_query_from_fused_qkv():
    """The engine passes q as a view of the fused qkv activation (row stride wider than heads x dim)."""
    lens = [3, 40, 17]
    _, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 3, 64, torch.bfloat16, seed=2)
    qkv = torch.randn(3, 6 * 64 + 2 * 2 * 64).to(torch.bfloat16)
    q = qkv[:, : 6 * 64].view(3, 6, 64)
    assert not q.is_contiguous()
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125, impl="cpu")
    ref = paged_attention_decode(q.contiguous(), k_cache, v_cache, table, seq_lens, 0.125, impl="torch")
    assert_close(out, ref.double(), torch.bfloat16)


def test_long_context_agrees_with_reference():
    """Hundreds of keys in shuffled blocks (the prefetch of the next block, the masked softmax tail)."""
    lens = [511, 700, 1, 255]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 3, 3, 64, torch.float32, seed=9)
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125, impl="cpu")
    ref = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125, impl="torch")
    assert_close(out, ref.double(), torch.float32)


def test_cpu_impl_unavailable_is_a_clear_error_and_auto_falls_back(monkeypatch):
    q, k_cache, v_cache, table, seq_lens = decode_batch([5, 9], 16, 1, 2, 64, torch.float32)
    expected = naive_decode(q, k_cache, v_cache, table, seq_lens, 0.125)
    monkeypatch.setattr(cpu, "_state", {"error": "RuntimeError: no compiler"})
    with pytest.raises(ValueError, match=r"impl='cpu': the C\+\+ CPU kernels are unavailable \(RuntimeError: no"):
        paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125, impl="cpu")
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125)  # auto -> torch reference
    assert_close(out, expected, torch.float32)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    assert cpu.load() is None
    assert "ops" not in cpu._state


def test_engine_attention_checks_the_first_layer_of_a_step():
    """The engine validates a step's metadata once (first layer), then skips the checks."""
    from tokenmill.engine.layers.attention import AttentionMetadata, paged_attention

    q, k_cache, v_cache, table, seq_lens = decode_batch([5, 9], 16, 1, 2, 64, torch.float32)
    k = torch.randn(2, 1, 64)
    md = AttentionMetadata(
        slot_mapping=torch.tensor([4, 8 + 16]),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 99], dtype=torch.int32),  # more than the 2-block table row holds
        block_tables=table,
        decode_only=True,
        max_query_len=1,
        max_seq_len=99,
    )
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=99 exceeds what block_tables can hold"):
        paged_attention(q, k, k, k_cache, v_cache, md, 0.125)
    assert not md.validated
    md.seq_lens = seq_lens
    out = paged_attention(q, k, k, k_cache, v_cache, md, 0.125)
    assert md.validated and out.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_with_its_long_chunks_in_one_run(dtype, monkeypatch):
    # The scheduler's usual mixed step: decode rows, then prompt chunks too big for the C++ kernel. The
    # chunks reach the reference as one view of q (no gathered copy), and their rows land in place.
    monkeypatch.setattr(ops, "CPU_MAX_ATTN_PAIRS", 4000)
    seq_lens, query_lens = [17, 40, 33, 120, 140], [1, 1, 1, 100, 90]
    assert [ops.too_big_for_cpu_kernel(n, s, dtype) for s, n in zip(seq_lens, query_lens, strict=True)] == [
        False, False, False, True, True
    ]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, 16, 1, 3, 64, dtype)
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 64, dtype=dtype)], dim=1)  # a fused row's q slice
    q_view = qkv[:, : q.shape[1] * 64].view(q.shape)
    seen = []
    real = ops.reference.paged_attention_prefill_torch

    def spy(q_arg, *args):
        seen.append(q_arg.data_ptr() == q_view[3].data_ptr())
        return real(q_arg, *args)

    monkeypatch.setattr(ops.reference, "paged_attention_prefill_torch", spy)
    out = paged_attention_prefill(q_view, k_cache, v_cache, table, qsl, lens, 0.125, impl="cpu")
    assert seen == [True]
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, 0.125), dtype)
