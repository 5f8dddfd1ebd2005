"""The grouped-layout kernels (kernels/csrc/cpu_grouped.cpp) on every format, against references outside them:
fp32 rows equal cpu_linear.cpp's fp32 panel kernel on gguf-py's dequantized weights bit for bit; bf16 rows
are within fp32 summation error of the exact product (the weights are not rounded); embedding rows are
the dequantized rows; the torch fallback (CUDA, no compiler) computes the same linear."""

import numpy as np
import pytest
import torch
from tokenmill.engine.bench.gguf_quantize import dequantize, quantize
from tokenmill.engine.layers.grouped_codes import CodesEmbedding, GroupedPackedWeight, SplitPackedWeight
from tokenmill.engine.layers.linear import CpuPackedWeight
from tokenmill.engine.model.gguf_weights import _codes_panels, _grouped_panels
from tokenmill.engine.quant_memory import GROUPED_GGUF
from tokenmill.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C++ CPU kernels")

N, K = 40, 512  # 40 rows: two full panels and a ragged third


def _weight(type_name: str, n: int = N, k: int = K) -> tuple[GroupedPackedWeight, torch.Tensor]:
    rng = np.random.default_rng(5)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, type_name)
    a = {name: torch.from_numpy(v) for name, v in _grouped_panels(type_name, raw).items()}
    e8, e16 = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.float16)
    w = GroupedPackedWeight(n, GROUPED_GGUF[type_name], a["lo"], a["hi"].view(torch.int32), a["sc"],
                            a.get("mn", e8), a["d"], a.get("dmin", e16))  # fmt: skip
    return w, torch.from_numpy(dequantize(raw, type_name))


@pytest.mark.parametrize("type_name", sorted(GROUPED_GGUF))
# 1-3 rows: tiles over 2-4 panels; 13: tiles of 6 (AVX2) or 8 and a rest; 131: past a 128-row block
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 13, 131])
def test_fp32_rows_equal_the_fp32_kernel_on_the_dequantized_weight(type_name, rows) -> None:
    w, ref = _weight(type_name)
    ops = cpu_kernels.load()
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    got = w.linear(x, bias)
    if not ops.packed_linear_supported():
        # A build without AVX2 + FMA (a capped tier): the scalar rebuild and tile, with no fp32 panel kernel to
        # match; against the float64 product within the error of a k-ordered fp32 sum (K + 1 roundings).
        exact = x.double() @ ref.double().T + bias.double()
        bound = (K + 1) * 2.0**-24 * (x.double().abs() @ ref.double().abs().T + bias.double().abs())
        assert bool(((got.double() - exact).abs() <= bound).all())
        return
    expect = torch.empty(rows, N)
    ops.linear_packed(expect, x, ops.pack_linear_weight(ref), bias)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("type_name", sorted(GROUPED_GGUF))
@pytest.mark.parametrize("rows", [1, 8, 9, 70])
def test_bf16_rows_are_the_exact_product_to_fp32_summation_error(type_name, rows) -> None:
    from tokenmill.engine.layers.cpu_gemm_policy import bf16_dot_supported

    w, ref = _weight(type_name)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = x.double() @ ref.double().T
    got = w.linear(x, out_dtype=torch.float32)
    # fp32 sums of exact products: each term's rounding is below 2^-24 of the running sum's magnitude,
    # bounded by sum |x| |w|; K terms plus the per-block scale and min steps.
    bound = (x.double().abs() @ ref.double().abs().T) * (K + 64) * 2.0**-24
    assert ((got.double() - exact).abs() <= bound).all()
    if bf16_dot_supported():  # the dot kernel does not round weights: far below bf16-weight error
        rounded = x.double() @ ref.bfloat16().double().T
        assert (got.double() - exact).abs().max() < (rounded - exact).abs().max() / 10
    out = w.linear(x)  # bf16 out: the same sums, rounded once
    assert out.dtype == torch.bfloat16 and torch.equal(out, got.bfloat16())


@pytest.mark.parametrize("type_name", sorted(GROUPED_GGUF))
def test_embedding_rows_are_the_dequantized_rows(type_name) -> None:
    w, ref = _weight(type_name)
    ids = torch.tensor([0, 39, 17, 17, 5])
    assert torch.equal(w.embedding(ids), ref[ids])
    w.embed_dtype = torch.bfloat16
    assert torch.equal(w.embedding(ids), ref[ids].bfloat16())
    with pytest.raises(RuntimeError, match=r"id 40 is outside the vocabulary \[0, 40\)"):
        w.embedding(torch.tensor([40]))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_codes_layout_embedding_reads_nibbles_and_fp16_scales(type_name) -> None:
    rng = np.random.default_rng(6)
    raw = quantize(rng.standard_normal((N, K)).astype(np.float32), type_name)
    ref = torch.from_numpy(dequantize(raw, type_name))
    ids = torch.tensor([3, 0, 39])
    for half in (False, True):
        a = {name: torch.from_numpy(v) for name, v in _codes_panels(type_name, raw, half).items()}
        assert (a["scales"].dtype == torch.float16) == half
        packed = CpuPackedWeight(N, codes=a["codes"], scales=a["scales"], mins=a["mins"])
        assert torch.equal(CodesEmbedding(packed, torch.float32).embedding(ids), ref[ids])
        assert torch.equal(CodesEmbedding(packed, torch.bfloat16).embedding(ids), ref[ids].bfloat16())


def test_the_torch_fallback_computes_the_same_linear(monkeypatch) -> None:
    """Where the C++ kernels are absent (no compiler) or the codes sit on a GPU, each call dequantizes
    with torch ops and runs F.linear."""
    w, ref = _weight("Q4_K")
    x = torch.randn(5, K)
    with_kernels = w.linear(x)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    torch.testing.assert_close(w.linear(x), with_kernels, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.embedding(torch.tensor([7])), ref[7:8])


def test_split_weights_concatenate_their_parts() -> None:
    a, _ = _weight("Q4_K", 32)
    b, _ = _weight("Q6_K", 24)
    split = SplitPackedWeight([a, b])
    x, bias = torch.randn(3, K), torch.randn(56)
    assert split.out_features == 56 and split.nbytes == a.nbytes + b.nbytes
    expect = torch.cat([a.linear(x, bias[:32]), b.linear(x, bias[32:])], dim=1)
    assert torch.equal(split.linear(x, bias), expect)


def test_wrong_arguments_name_the_problem() -> None:
    w, _ = _weight("Q4_K")
    ops = cpu_kernels.load()
    out = torch.empty(2, N)
    with pytest.raises(RuntimeError, match=r"unsupported format bits=7"):
        ops.linear_grouped(out, torch.randn(2, K), w.lo, w.hi, w.sc, w.mn, w.d, w.dmin, [7, 32, 256, 0], None)
    with pytest.raises(RuntimeError, match=r"lo must be contiguous uint8 \[panels, K / 2, 16\]"):
        ops.linear_grouped(out, torch.randn(2, K + 32), w.lo, w.hi, w.sc, w.mn, w.d, w.dmin, w.fmt_list, None)
    with pytest.raises(RuntimeError, match=r"out has 49 columns, the weight 3 panels of 16"):
        ops.linear_grouped(torch.empty(2, 49), torch.randn(2, K), w.lo, w.hi, w.sc, w.mn, w.d, w.dmin, w.fmt_list, None)
