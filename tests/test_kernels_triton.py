"""Triton kernels on CPU through Triton's interpreter, against the torch reference and the naive oracle.

@triton.jit decides at decoration (import) time whether a kernel runs through the interpreter, so a
module-scoped fixture sets TRITON_INTERPRET=1 and drops any already-imported kernel modules so that
they are decorated again; afterwards it restores the variable and drops them once more. Other test
modules in the same session therefore see neither the variable nor interpreted kernels.
"""

import importlib
import math
import os
import sys

import pytest
import torch
from test_kernels_common import (
    assert_close,
    decode_batch,
    make_cache,
    naive_decode,
    naive_prefill,
    prefill_batch,
)
from tokenmill.kernels import paged_attention_decode, paged_attention_prefill, store_kv

_TRITON_MODULES = ("triton_common", "triton_store_kv", "triton_decode", "triton_prefill")


def _drop_triton_modules() -> None:
    for name in _TRITON_MODULES:
        sys.modules.pop(f"tokenmill.kernels.{name}", None)


@pytest.fixture(scope="module", autouse=True)
def _triton_interpreter():
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _drop_triton_modules()
    yield
    if saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = saved
    _drop_triton_modules()


def paged_attention_decode_triton(*args, **kwargs):
    """The Triton decode wrapper itself (to force a split count), imported under the interpreter."""
    return importlib.import_module("tokenmill.kernels.triton_decode").paged_attention_decode_triton(
        *args, **kwargs
    )


torch.set_num_threads(1)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_triton_matches_reference(dtype):
    k_cache, v_cache = make_cache(5, 16, 3, 64, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # Key/value as strided slices of a fused projection, as a model would produce them.
    fused = torch.randn(6, 2, 3, 64).to(dtype)
    key, value = fused[:, 0], fused[:, 1]
    slots = torch.tensor([3, -1, 79, 16, -1, 40], dtype=torch.int64)
    store_kv(key, value, k_cache, v_cache, slots, impl="triton")
    store_kv(key, value, k_ref, v_ref, slots, impl="torch")
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[4, 15], key[2])  # slot 79 = block 4, offset 15
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[[3, 79, 16, 40]] = False
    fresh_k, _ = make_cache(5, 16, 3, 64, dtype)
    assert torch.equal(k_cache.view(80, 3, 64)[untouched], fresh_k.view(80, 3, 64)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (1, 3), (1, 8)])
def test_decode_triton_matches_reference_and_naive(dtype, block_size, num_kv_heads, group):
    bs = block_size
    lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, bs, num_kv_heads, group, 64, dtype)
    scale = 1 / math.sqrt(64)
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale, impl="triton")
    ref = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale, impl="torch")
    assert_close(out, ref, dtype, "triton vs torch reference")
    assert_close(out, naive_decode(q, k_cache, v_cache, table, seq_lens, scale), dtype, "triton vs naive")


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_triton_head_dim_128_splits_and_empty_rows(num_splits, dtype):
    # Splits past a short sequence's end are empty and must merge to the right answer; seq_len 0
    # (padding rows of a captured batch) must give zeros, not NaN.
    lens = [0, 200, 1, 33]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, 32, 2, 2, 128, dtype)
    out = paged_attention_decode_triton(q, k_cache, v_cache, table, seq_lens, 0.08, num_splits=num_splits)
    assert_close(out, naive_decode(q, k_cache, v_cache, table, seq_lens, 0.08), dtype, "triton vs naive")
    assert torch.count_nonzero(out[0]) == 0


def test_decode_triton_clamps_seq_len_to_table_without_reading_past_it():
    # Validation skips device tensors' values; the kernel itself must still not read past the row.
    q, k_cache, v_cache, table, _ = decode_batch([32, 32], 16, 1, 2, 64, torch.float32)
    table = table[:, :2].contiguous()
    out = paged_attention_decode_triton(
        q, k_cache, v_cache, table, torch.tensor([32, 999], dtype=torch.int32), 0.1
    )
    expected = naive_decode(q, k_cache, v_cache, table, torch.tensor([32, 32], dtype=torch.int32), 0.1)
    assert_close(out, expected, torch.float32, "clamped")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (1, 3), (1, 8)])
def test_prefill_triton_matches_reference_and_naive(dtype, block_size, num_kv_heads, group):
    bs = block_size
    # Fresh prompts at the edge lengths, chunks starting mid-block after a cached prefix (longer
    # than one query tile), a chunk on a block boundary, a decode-like row, an idle sequence.
    seq_lens = [1, bs - 1, bs, bs + 1, 3 * bs + 3, bs + 7, 2 * bs + 45, 2 * bs, 30]
    query_lens = [1, bs - 1, bs, bs + 1, 3 * bs + 3, 3, 40, bs, 0]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(
        seq_lens, query_lens, bs, num_kv_heads, group, 64, dtype
    )
    scale = 1 / math.sqrt(64)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, scale, impl="triton")
    ref = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, scale, impl="torch")
    assert_close(out, ref, dtype, "triton vs torch reference")
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, scale), dtype, "triton vs naive")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_triton_head_dim_128(dtype):
    seq_lens, query_lens = [70, 45, 1], [70, 20, 1]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, 16, 2, 2, 128, dtype)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, 0.09, impl="triton")
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, 0.09), dtype, "triton vs naive")


def test_triton_rejects_bad_input_like_the_reference():
    q, k_cache, v_cache, table, seq_lens = decode_batch([5, 20], 16, 2, 2, 64, torch.float32)
    with pytest.raises(
        ValueError, match=r"block_tables must be torch.int32 \[num_seqs, max_blocks_per_seq\]"
    ):
        paged_attention_decode(q, k_cache, v_cache, table.long(), seq_lens, 0.1, impl="triton")
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=49 exceeds what block_tables can hold"):
        paged_attention_decode(
            q, k_cache, v_cache, table, torch.tensor([5, 49], dtype=torch.int32), 0.1, impl="triton"
        )
    with pytest.raises(ValueError, match=r"num_splits must be a power of two >= 1, got 3"):
        paged_attention_decode_triton(q, k_cache, v_cache, table, seq_lens, 0.1, num_splits=3)
    q80, k80, v80, t80, l80 = decode_batch([5], 16, 1, 1, 80, torch.float32)
    with pytest.raises(ValueError, match=r"impl='triton' needs head_dim a power of two >= 16 .* got 80"):
        paged_attention_decode(q80, k80, v80, t80, l80, 0.1, impl="triton")


def test_triton_strided_q_gives_contiguous_output():
    lens = [20, 7, 33]
    _, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 3, 64, torch.float32)
    qkv = torch.randn(3, 10 * 64)
    q = qkv[:, : 6 * 64].view(3, 6, 64)
    expected = naive_decode(q, k_cache, v_cache, table, seq_lens, 0.125)
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125, impl="triton")
    assert out.is_contiguous()
    assert_close(out, expected, torch.float32, "decode")
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, seq_lens, 0.125, impl="triton")
    assert out.is_contiguous()
    assert_close(out, expected, torch.float32, "prefill")


# ---- 8-bit KV caches (kernels/kv_quant.py): what CUDA runs for --kv-cache-dtype fp8 / int8 ----
KV8 = [torch.int8, torch.float8_e4m3fn]


def _kv8(k_cache, v_cache, dtype):
    from tokenmill.kernels import kv_quant

    kq, vq = kv_quant.quantize_rows(k_cache, dtype), kv_quant.quantize_rows(v_cache, dtype)
    return kq, vq, kv_quant.dequantize_rows(kq, torch.float64), kv_quant.dequantize_rows(vq, torch.float64)


@pytest.mark.parametrize("cache_dtype", [*KV8, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_triton_8bit_writes_the_reference_bytes(cache_dtype, dtype):
    k_cache = torch.zeros(5, 16, 3, 68, dtype=cache_dtype)
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    fused = (torch.randn(6, 2, 3, 64, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    fused[1, 0, 1] = 0  # scale 0
    fused[0, 1, 2, :9] = 2e-5  # fp8 subnormals after scaling
    slots = torch.tensor([3, -1, 79, 16, -1, 40], dtype=torch.int64)
    store_kv(fused[:, 0], fused[:, 1], k_cache, v_cache, slots, impl="triton")
    store_kv(fused[:, 0], fused[:, 1], k_ref, v_ref, slots, impl="torch")
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", KV8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_triton_on_8bit_cache_matches_naive(cache_dtype, dtype, num_splits):
    lens = [1, 15, 16, 17, 83, 0]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 3, 64, dtype, seed=5)
    kq, vq, kd, vd = _kv8(k_cache, v_cache, cache_dtype)
    out = paged_attention_decode_triton(q, kq, vq, table, seq_lens, 0.125, num_splits=num_splits)
    assert_close(out, naive_decode(q, kd, vd, table, seq_lens, 0.125), dtype, f"triton {cache_dtype}")
    assert torch.count_nonzero(out[5]) == 0


@pytest.mark.parametrize("cache_dtype", KV8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_triton_on_8bit_cache_matches_naive(cache_dtype, dtype):
    seq_lens, query_lens = [1, 15, 17, 50, 23, 40], [1, 15, 17, 40, 3, 0]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, 16, 1, 3, 64, dtype)
    kq, vq, kd, vd = _kv8(k_cache, v_cache, cache_dtype)
    out = paged_attention_prefill(q, kq, vq, table, qsl, lens, 0.125, impl="triton")
    assert_close(out, naive_prefill(q, kd, vd, table, qsl, lens, 0.125), dtype, f"triton {cache_dtype}")
