"""8-bit KV caches (kernels/kv_quant.py): the quantizer against hand-computed rows, the C++ store against it
bit for bit, and the C++ and torch attention on 8-bit caches against the float64 oracle run on the same
dequantized values (so the tolerance is the attention's own, not the quantization's).

Which C++ path runs (AVX-512, AVX2, portable) follows the CPU tier (kernels/cpu_probe.py); `make test` runs
this module again under every lower tier (tests/conftest.py CPU_TIER_MODULES). head_dim 80 takes the
portable path on every tier.
"""

import math

import pytest
import torch
from test_kernels_common import assert_close, decode_batch, naive_decode, naive_prefill, prefill_batch
from tokenmill.kernels import cpu, kv_quant, ops, paged_attention_decode, paged_attention_prefill, store_kv

torch.set_num_threads(1)

KV8 = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def quantized(k_cache, v_cache, dtype):
    """8-bit copies of 16/32-bit caches, and their float64 dequantized values (what the kernels must see)."""
    kq, vq = kv_quant.quantize_rows(k_cache, dtype), kv_quant.quantize_rows(v_cache, dtype)
    return kq, vq, kv_quant.dequantize_rows(kq, torch.float64), kv_quant.dequantize_rows(vq, torch.float64)


def test_int8_rows_by_hand():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]])
    codes, scale = kv_quant.quantize_kv(x, torch.int8)
    # scale = 4 / 127; x / scale = 31.75, -63.5, 15.875, 127: -63.5 rounds to the even -64
    assert codes.tolist() == [[32, -64, 16, 127], [0, 0, 0, 0]]
    assert scale[0, 0] == torch.tensor(4.0) / 127 and scale[1, 0] == 0
    rows = kv_quant.quantize_rows(x, torch.int8)
    assert rows.shape == (2, 8) and rows.dtype == torch.int8
    assert rows[0, 4:].view(torch.float32).item() == scale[0, 0].item()  # the scale's bytes follow the codes
    assert torch.equal(kv_quant.dequantize_rows(rows, torch.float32)[1], torch.zeros(4))


def test_fp8_rows_by_hand():
    x = torch.tensor([[448.0 / 2, -448.0, 1.0, 0.0]])
    codes, scale = kv_quant.quantize_kv(x, torch.float8_e4m3fn)
    assert scale.item() == 1.0 and codes.float().tolist() == [[224.0, -448.0, 1.0, 0.0]]
    codes, scale = kv_quant.quantize_kv(x * 3, torch.float8_e4m3fn)  # scale 3: the same codes
    assert scale.item() == 3.0 and codes.float().tolist() == [[224.0, -448.0, 1.0, 0.0]]


@pytest.mark.parametrize("dtype", KV8)
def test_quantization_error_is_within_half_a_step(dtype):
    x = torch.randn(64, 3, 64) * torch.logspace(-3, 2, 64)[:, None, None]  # rows of very different magnitudes
    rows = kv_quant.quantize_rows(x, dtype)
    err = (kv_quant.dequantize_rows(rows, torch.float64) - x.double()).abs()
    absmax = x.abs().amax(-1, keepdim=True).double()
    if dtype == torch.int8:
        bound = absmax / 127 / 2 * (1 + 1e-6)  # half a code step
    else:  # half an ulp of the fp8 value, relative (3 or 2 mantissa bits), or the subnormal spacing
        mant, min_exp = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
        step = absmax / kv_quant.KV_QMAX[dtype] * 2.0**min_exp * 2.0**-mant
        bound = torch.maximum(x.abs().double() * 2.0**-(mant + 1), step / 2) * (1 + 1e-6)
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("dtype", KV8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_store_writes_the_reference_bytes(dtype, src):
    assert cpu.load() is not None, f"C++ CPU kernels failed to build: {cpu.unavailable_reason()}"
    g = torch.Generator().manual_seed(3)
    fused = (torch.randn(7, 2, 3, 64, generator=g) * 5).to(src)  # key/value: strided slices of one projection
    fused[1, 0, 2] = 0  # an all-zero row: scale 0
    fused[4, 1, 0, :7] = 1e-6  # tiny values: fp8 subnormals
    slots = torch.tensor([3, -1, 79, 16, -1, 40, 0], dtype=torch.int64)
    k_cpu = torch.zeros(5, 16, 3, 68, dtype=dtype)
    v_cpu, k_ref, v_ref = k_cpu.clone(), k_cpu.clone(), k_cpu.clone()
    store_kv(fused[:, 0], fused[:, 1], k_cpu, v_cpu, slots, impl="cpu")
    store_kv(fused[:, 0], fused[:, 1], k_ref, v_ref, slots, impl="torch")
    assert torch.equal(k_cpu.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cpu.view(torch.uint8), v_ref.view(torch.uint8))
    assert torch.equal(k_cpu.view(80, 3, 68)[79].view(torch.uint8), kv_quant.quantize_rows(fused[2, 0], dtype).view(torch.uint8))
    written = torch.zeros(80, dtype=torch.bool)
    written[[3, 79, 16, 40, 0]] = True
    assert k_cpu.view(80, -1)[~written].view(torch.uint8).count_nonzero() == 0  # slot -1 rows wrote nothing


@pytest.mark.parametrize("dtype", KV8)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: the portable path on every tier
@pytest.mark.parametrize("impl", ["cpu", "torch"])
def test_decode_on_8bit_cache_matches_naive(dtype, qdtype, head_dim, impl):
    lens = [1, 15, 16, 17, 83, 0, 200]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 3, head_dim, qdtype, seed=5)
    kq, vq, kd, vd = quantized(k_cache, v_cache, dtype)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention_decode(q, kq, vq, table, seq_lens, scale, impl=impl)
    assert_close(out, naive_decode(q, kd, vd, table, seq_lens, scale), qdtype, f"{impl} {dtype}")
    assert torch.count_nonzero(out[5]) == 0  # a zero-length row (batch padding) gives zeros


@pytest.mark.parametrize("dtype", KV8)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_prefill_on_8bit_cache_matches_naive(dtype, qdtype, monkeypatch):
    # A small pair limit sends the long chunks to the reference in the same call (its 8-bit gather).
    monkeypatch.setattr(ops, "CPU_MAX_ATTN_PAIRS", 4000)
    seq_lens, query_lens = [1, 15, 17, 98, 23, 118, 32, 40], [1, 15, 17, 98, 3, 98, 1, 0]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, 16, 1, 3, 64, qdtype)
    kq, vq, kd, vd = quantized(k_cache, v_cache, dtype)
    out = paged_attention_prefill(q, kq, vq, table, qsl, lens, 0.125, impl="cpu")
    assert_close(out, naive_prefill(q, kd, vd, table, qsl, lens, 0.125), qdtype, f"cpu {dtype}")


def test_attention_after_store_sees_the_dequantized_rows():
    """The store and the attention agree on the layout: keys written by the C++ store are read back by the
    C++ kernel as their dequantized values."""
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(20, 2, 64, generator=g), torch.randn(20, 2, 64, generator=g)
    k_cache = torch.zeros(4, 16, 2, 68, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = torch.tensor([32 + i for i in range(16)] + list(range(4)))
    store_kv(k, v, k_cache, v_cache, slots, impl="cpu")
    q = torch.randn(1, 4, 64, generator=g)
    lens = torch.tensor([20], dtype=torch.int32)
    out = paged_attention_decode(q, k_cache, v_cache, table, lens, 0.125, impl="cpu")
    kd = kv_quant.dequantize_rows(kv_quant.quantize_rows(k, torch.int8), torch.float64)
    vd = kv_quant.dequantize_rows(kv_quant.quantize_rows(v, torch.int8), torch.float64)
    expected = torch.softmax((q.double()[0].view(2, 2, 64) @ kd.transpose(0, 1).transpose(1, 2)) * 0.125, -1) @ vd.transpose(0, 1)
    assert_close(out, expected.reshape(1, 4, 64), torch.float32)


def test_bad_8bit_caches_are_clear_errors():
    q, k_cache, _, table, seq_lens = decode_batch([5], 16, 2, 1, 64, torch.float32)
    narrow = torch.zeros(k_cache.shape, dtype=torch.int8)  # head_dim wide: no room for the scale
    with pytest.raises(ValueError, match=r"head_dim=60\], got \[1, 2, 64\] \(an 8-bit cache's rows are head_dim \+ 4"):
        paged_attention_decode(q, narrow, narrow, table, seq_lens, 0.1)
    wide = torch.zeros(*k_cache.shape[:3], 68, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"v_cache dtype must equal k_cache dtype torch\.int8"):
        paged_attention_decode(q, wide, wide.to(torch.float8_e4m3fn), table, seq_lens, 0.1)
    with pytest.raises(ValueError, match=r"q dtype must be float32/float16/bfloat16, got torch\.int8"):
        paged_attention_decode(q.to(torch.int8), wide, wide, table, seq_lens, 0.1)
    with pytest.raises(ValueError, match=r"an 8-bit cache is .* head_dim \+ 4"):
        odd = torch.zeros(*k_cache.shape[:3], 66, dtype=torch.int8)
        store_kv(torch.zeros(1, 2, 62), torch.zeros(1, 2, 62), odd, odd, torch.tensor([0]))
