"""The bf16 dot kernel on integer codes (kernels/csrc/cpu_linear_bf16.cpp), for bf16 models on CPUs with
AVX-512 BF16: the codes are the bf16 operands, sum_k x_k (d c_k + m) = d sum_k x_k c_k + m sum_k x_k per
block of 32.

Its products are exact and its sums fp32, so every output must lie within half a bf16 ulp of the exact
product with the fp32 weights (their values, not their bf16 rounding) plus an fp32 summation bound.
"""

import pytest
import torch
import torch.nn.functional as F
from quantized_weights import quantized_weight
from tokenmill.engine.layers import bf16_dot_supported, codes_weight, nibble_codes
from tokenmill.kernels import cpu as cpu_kernels

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not bf16_dot_supported(), reason="needs AVX-512 BF16 and the C++ kernels")


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    # fp32 sums of 32-term blocks, then the blocks: a few hundred ulps of fp32 at most against the
    # magnitudes summed (|x| |d c| and |x| |m| bound every partial sum).
    scale = x.double().abs() @ w.double().abs().T + x.double().abs().sum(-1, keepdim=True) * 0.1 + 1
    bound = 2e-5 * scale
    if out.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8  # one rounding to bf16
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} over bound {(err - bound).max().item():.3g}"


# N 50: a ragged last panel; rows 1-19 cover every tile height (8-row tiles and the remainder);
# K 96 and 576 (SmolLM2's hidden size).
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(50, 96), (64, 576)])
def test_dot_kernel_is_the_exact_product_rounded(kind: str, n: int, k: int) -> None:
    w = quantized_weight(n, k, kind, seed=n + k)
    packed = codes_weight(w, nibbles=True)
    assert packed is not None and packed.codes.dtype == (torch.uint8 if kind == "q4_1" else torch.int8)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    ops = cpu_kernels.load()
    g = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 7, 8, 9, 16, 19):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            for dtype in (torch.bfloat16, torch.float32):
                out = torch.full((rows, n), float("nan"), dtype=dtype)
                ops.linear_codes_bf16(out, x, packed.codes, packed.scales, packed.mins, b)
                _check(out, x, w, b)


def test_rows_a_stride_apart_and_a_rows_result_does_not_depend_on_the_batch() -> None:
    w = quantized_weight(40, 128, "q4_1", seed=3)
    packed = codes_weight(w)
    ops = cpu_kernels.load()
    wide = torch.randn(11, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = wide[:, :128]  # rows 256 elements apart
    out = torch.empty(11, 40, dtype=torch.bfloat16)
    ops.linear_codes_bf16(out, x, packed.codes, packed.scales, packed.mins, None)
    _check(out, x, w, None)
    one = torch.empty(1, 40, dtype=torch.bfloat16)
    ops.linear_codes_bf16(one, x[9:10].contiguous(), packed.codes, packed.scales, packed.mins, None)
    assert torch.equal(one[0], out[9])


def test_int8_and_nibble_codes_give_the_same_results() -> None:
    w = quantized_weight(48, 192, "q4_1", seed=4)
    nib, byte = codes_weight(w, nibbles=True), codes_weight(w, nibbles=False)
    assert torch.equal(nib.codes, nibble_codes(byte.codes))
    x = torch.randn(5, 192).to(torch.bfloat16)
    outs = []
    for p in (nib, byte):
        out = torch.empty(5, 48, dtype=torch.float32)
        cpu_kernels.load().linear_codes_bf16(out, x, p.codes, p.scales, p.mins, None)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_wrong_arguments_are_refused_with_what_was_expected() -> None:
    packed = codes_weight(quantized_weight(32, 64, "q4_1", seed=5))
    ops = cpu_kernels.load()
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        ops.linear_codes_bf16(torch.empty(2, 32), x.float(), packed.codes, packed.scales, packed.mins, None)
    with pytest.raises(RuntimeError, match="out must be 2-D bfloat16 or float32"):
        ops.linear_codes_bf16(torch.empty(2, 32, dtype=torch.float16), x, packed.codes, packed.scales, packed.mins, None)
    with pytest.raises(RuntimeError, match="out has 40 columns, the codes 2 panels of 16"):
        ops.linear_codes_bf16(torch.empty(2, 40), x, packed.codes, packed.scales, packed.mins, None)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[32\]"):
        ops.linear_codes_bf16(torch.empty(2, 32), x, packed.codes, packed.scales, packed.mins, torch.zeros(31))
