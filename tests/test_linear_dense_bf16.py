"""The dense bf16 kernel (kernels/csrc/cpu_dense_bf16.cpp) for bf16 weights without integer codes (the
weights of a checkpoint stored in bf16), and the fp32-FMA GEMM for larger batches of bf16 models on dense
panels and on integer codes (cpu_gemm_bf16.cpp). vdpbf16ps multiplies bf16 x by the bf16 weights exactly and sums in
fp32, so every output must lie within an fp32 summation bound of the exact product (plus one rounding to
bf16 for bf16 out). Runs where the CPU (or the capped tier) has AVX-512 BF16; elsewhere each test is
skipped with the tier it needs.
"""

import pytest
import torch
import torch.nn.functional as F
from quantized_weights import quantized_weight
from tokenmill.engine.layers.cpu_gemm_policy import dense_bf16_supported
from tokenmill.engine.layers.linear import Linear, codes_weight, dense_bf16_weight
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels.cpu_probe import needs, probe

dense = pytest.mark.skipif(not dense_bf16_supported(), reason=needs("avx512_bf16"))


def _ops():
    return cpu_kernels.load()


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    # fp32 sums of K products: each partial sum is within K ulps of fp32 of the sum of magnitudes.
    scale = x.double().abs() @ w.double().abs().T + 1
    bound = x.shape[1] * 2.0**-24 * scale
    if out.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8  # one rounding to bf16
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), (
        f"max error {err.max().item():.3g} over bound {(err - bound).max().item():.3g}"
    )


def _check_batches(op, w: torch.Tensor, packed: torch.Tensor, rows: tuple[int, ...]) -> None:
    """op(out, x, packed, bias) on random bf16 x of each row count, with and without a bias, to bf16 and
    fp32 out, each within _check's bound; the dense kernel's and the GEMM's tests run the same sweep."""
    n, k = w.shape
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1)
    for m in rows:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            for dtype in (torch.bfloat16, torch.float32):
                out = torch.full((m, n), float("nan"), dtype=dtype)
                op(out, x, packed, b)
                _check(out, x, w.float(), b)


@dense
# N 50 and 200: ragged last panels and groups of 1-4 panels; rows 1-13 cover every tile height (6-row
# tiles and each remainder), 64 a decode batch, 300 two row blocks; K 96 and 960 (the 360M model's).
@pytest.mark.parametrize("n,k", [(50, 96), (200, 960)])
def test_kernel_gives_the_exact_product_rounded(n: int, k: int) -> None:
    w = _weight(n, k, seed=n + k)
    packed = _ops().pack_bf16_weight(w)
    assert packed.shape == ((n + 15) // 16, k // 2, 32) and packed.dtype == torch.bfloat16
    _check_batches(_ops().linear_dense_bf16, w, packed, (1, 2, 3, 5, 6, 7, 12, 13, 64, 300))


@dense
def test_a_rows_result_does_not_depend_on_the_batch_or_the_row_stride() -> None:
    w = _weight(40, 128, seed=3)
    packed = _ops().pack_bf16_weight(w)
    wide = torch.randn(29, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = wide[:, :128]  # rows 256 elements apart
    out = torch.empty(29, 40, dtype=torch.bfloat16)
    _ops().linear_dense_bf16(out, x, packed, None)
    _check(out, x, w.float(), None)
    for r in (0, 9, 28):
        one = torch.empty(1, 40, dtype=torch.bfloat16)
        _ops().linear_dense_bf16(one, x[r : r + 1].contiguous(), packed, None)
        assert torch.equal(one[0], out[r])


@dense
def test_embedding_rows_come_back_from_the_panels_exactly() -> None:
    w = _weight(50, 96, seed=9)
    packed = dense_bf16_weight(w)
    ids = torch.tensor([0, 49, 17, 17, 3])
    assert torch.equal(packed.embedding(ids), w[ids])
    with pytest.raises(RuntimeError, match=r"id 50 is outside \[0, 50\)"):
        packed.embedding(torch.tensor([50]))


@dense
def test_linear_module_on_dense_panels_keeps_one_copy_and_matches_the_exact_product() -> None:
    lin = Linear(96, 50, bias=True).to(torch.bfloat16)
    w, b = lin.weight.detach().clone(), lin.bias.detach().float().clone()
    lin.pack_dense()
    assert lin.weight is None and lin.packed_cpu.dense is not None and lin.packed is None
    for rows in (1, 8, 70):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        _check(lin(x), x, w.float(), b)


@dense
def test_wrong_arguments_are_refused_with_what_was_expected() -> None:
    ops = _ops()
    packed = ops.pack_bf16_weight(_weight(32, 64, seed=5))
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        ops.linear_dense_bf16(torch.empty(2, 32), x.float(), packed, None)
    with pytest.raises(RuntimeError, match="out must be 2-D bfloat16 or float32"):
        ops.linear_dense_bf16(torch.empty(2, 32, dtype=torch.float16), x, packed, None)
    with pytest.raises(RuntimeError, match="out has 40 columns, the packed weight 2 panels of 16"):
        ops.linear_dense_bf16(torch.empty(2, 40), x, packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[32\]"):
        ops.linear_dense_bf16(torch.empty(2, 32), x, packed, torch.zeros(31))
    with pytest.raises(RuntimeError, match=r"pack_bf16_weight's bfloat16 \[panels, K / 2 = 48, 32\]"):
        ops.linear_dense_bf16(torch.empty(2, 32), torch.randn(2, 96).to(torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="in_features=63 must be even"):
        ops.pack_bf16_weight(_weight(32, 63, seed=1))
    with pytest.raises(RuntimeError, match="weight must be a 2-D bfloat16"):
        ops.pack_bf16_weight(torch.zeros(32, 64))


# ---- the dense kernel on integer codes rebuilt to bf16 panels (linear_codes_dense) ------------------------


@dense
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("half_scales", [False, True])
@pytest.mark.parametrize("n", [200, 170, 90])
def test_codes_dense_equals_the_dense_kernel_on_the_bf16_cast_bit_for_bit(kind: str, half_scales: bool, n: int) -> None:
    # The codes rebuilt as bf16(d c + m) are the weights the model cast to bf16 holds, so the results must
    # be linear_dense_bf16's on pack_bf16_weight of that cast, bit for bit. N 200, 170, 90: groups of 4
    # panels and a last group of 1, 3 and 2 panels, the last panel ragged (8, 10, 10 columns); rows 1-13
    # every tile height, 64 a decode batch, 260 two row blocks; K 576 (the bundled model's) in blocks of 32.
    k = 576
    w = quantized_weight(n, k, kind, seed=21)
    if half_scales and kind == "q4_1":  # GGUF's fp16 mins, as bf16 models keep them: each block's smallest code 0
        blocks = w.double().view(n, k // 32, 32)
        w = (blocks - blocks.amin(-1, keepdim=True) + blocks.amin(-1, keepdim=True).half().double()).float().view(n, k)
    packed = codes_weight(w, nibbles=True)
    assert (packed.codes.dtype == torch.uint8) == (kind == "q4_1")  # nibbles and int8 codes both run
    scales, mins = (packed.scales.half(), packed.mins.half()) if half_scales else (packed.scales, packed.mins)
    assert torch.equal(scales.float(), packed.scales) and torch.equal(mins.float(), packed.mins)
    dense_w = _ops().pack_bf16_weight(w.to(torch.bfloat16))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    g = torch.Generator().manual_seed(9)
    for m in (*range(1, 14), 64, 260):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b, dtype in ((None, torch.bfloat16), (bias, torch.float32)):
            got = torch.full((m, n), float("nan"), dtype=dtype)
            _ops().linear_codes_dense(got, x, packed.codes, scales, mins, b)
            want = torch.empty(m, n, dtype=dtype)
            _ops().linear_dense_bf16(want, x, dense_w, b)
            assert torch.equal(got, want), f"{m} rows, {dtype}: max difference {(got - want).abs().max().item()}"
    # ...and the product within the dense kernel's bound of the bf16 weights' exact product.
    _check(got, x, w.to(torch.bfloat16).float(), bias)


@dense
def test_codes_dense_refuses_codes_that_do_not_match_x() -> None:
    packed = codes_weight(quantized_weight(32, 64, "q4_1", seed=3), nibbles=True)
    x = torch.randn(2, 96).to(torch.bfloat16)  # K 96: the codes hold K 64
    with pytest.raises(RuntimeError, match="linear_codes_dense"):
        _ops().linear_codes_dense(torch.empty(2, 32), x, packed.codes, packed.scales, packed.mins, None)
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        _ops().linear_codes_dense(torch.empty(2, 32), torch.randn(2, 64), packed.codes, packed.scales, packed.mins, None)


# ---- the fp32-FMA GEMM for larger batches (kernels/csrc/cpu_gemm_bf16.cpp) --------------------------


def _gemm_built() -> bool:
    ops = cpu_kernels.load()
    return ops is not None and ops.gemm_bf16_supported()


gemm = pytest.mark.skipif(not _gemm_built(), reason=needs("avx512"))


# K 2100 and 2080: three K-slices of 1024 (the running sums stored between them); N 50: a ragged last
# group (3 panels + 1) and a ragged last panel; rows 1-9 every tile height, 130: two row blocks.
@gemm
@pytest.mark.parametrize("n,k", [(50, 96), (200, 2100)])
def test_dense_gemm_gives_the_exact_product_rounded(n: int, k: int) -> None:
    w = _weight(n, k, seed=n + k)
    _check_batches(_ops().linear_dense_gemm, w, _ops().pack_bf16_weight(w), (1, 7, 9, 24, 130))


@gemm
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("half_scales", [False, True])
def test_codes_gemm_multiplies_by_the_fp32_weights(kind: str, half_scales: bool) -> None:
    w = quantized_weight(50, 2080, kind, seed=11)
    if half_scales:  # GGUF's fp16 scales and mins, as bf16 models keep them: each block's smallest code 0
        blocks = w.double().view(50, 65, 32)
        w = (blocks - blocks.amin(-1, keepdim=True) + blocks.amin(-1, keepdim=True).half().double()).float()
        w = w.view(50, 2080) if kind == "q4_1" else quantized_weight(50, 2080, kind, seed=11)
    packed = codes_weight(w, nibbles=True)
    scales, mins = packed.scales, packed.mins
    if half_scales:
        assert torch.equal(scales.half().float(), scales) and torch.equal(mins.half().float(), mins)
        scales, mins = scales.half(), mins.half()
    g = torch.Generator().manual_seed(4)
    for rows in (3, 40):
        x = torch.randn(rows, 2080, generator=g).to(torch.bfloat16)
        out = torch.empty(rows, 50, dtype=torch.float32)
        _ops().linear_codes_gemm(out, x, packed.codes, scales, mins, None)
        _check(out, x, w, None)


@gemm
def test_gemm_rows_do_not_depend_on_the_batch_and_equal_across_thread_counts() -> None:
    w = _weight(72, 320, seed=12)
    packed = _ops().pack_bf16_weight(w)
    x = torch.randn(45, 320, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = torch.empty(45, 72, dtype=torch.float32)
        _ops().linear_dense_gemm(out, x, packed, None)
        outs.append(out)
    torch.set_num_threads(1)
    assert torch.equal(outs[0], outs[1])
    for r in (0, 17, 44):
        one = torch.empty(1, 72, dtype=torch.float32)
        _ops().linear_dense_gemm(one, x[r : r + 1].contiguous(), packed, None)
        assert torch.equal(one[0], outs[0][r])


@gemm
def test_gemm_rates_are_measured_and_refused_arguments_name_the_limit() -> None:
    ops = _ops()
    dot, fma = ops.bf16_dot_fma_gflops()
    # Both rates are timed only where vdpbf16ps exists (bf16_gemm_min_rows asks for them only there);
    # an AVX-512 build without BF16 reports zeros.
    bf16 = probe().at_least("avx512_bf16")
    assert (dot > 0) == bf16 and (fma > 0) == bf16
    packed = ops.pack_bf16_weight(_weight(32, 64, seed=5))
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        ops.linear_dense_gemm(torch.empty(2, 32), torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match=r"pack_bf16_weight's bfloat16 \[panels, K / 2 = 48, 32\]"):
        ops.linear_dense_gemm(torch.empty(2, 32), torch.randn(2, 96).to(torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="out has 40 columns, the packed weight 2 panels of 16"):
        ops.linear_dense_gemm(torch.empty(2, 40), torch.randn(2, 64).to(torch.bfloat16), packed, None)
