"""The bf16 kernels on integer codes, for bf16 models: the AVX-512 BF16 dot kernel
(kernels/csrc/cpu_linear_bf16.cpp) and the AMX tile kernels (cpu_linear_amx.cpp). The dot kernel and
linear_codes_amx take the codes as bf16 operands, sum_k x_k (d c_k + m) = d sum_k x_k c_k + m sum_k x_k
per block of 32; linear_dequant_amx rebuilds the bf16 model's weights, bf16(d c + m), and multiplies by
those (what oneDNN does with the bf16 weight).

Their products are exact and their sums fp32, so every output must lie within half a bf16 ulp of the
exact product with the weights each kernel means (fp32 values, or their bf16 rounding) plus an fp32
summation bound. Each test runs for every kernel this CPU has; the others are reported as skipped.
"""
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from quantized_weights import quantized_weight
from tokenmill.engine.layers.cpu_gemm_policy import amx_codes_supported, bf16_dot_supported
from tokenmill.engine.layers.linear import bf16_codes_weight, codes_weight, nibble_codes
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels.cpu_probe import needs

CPU = torch.device("cpu")
KERNELS = [
    pytest.param("linear_codes_bf16", marks=pytest.mark.skipif(not bf16_dot_supported(),
                                                               reason=needs("avx512_bf16"))),
    pytest.param("linear_codes_amx", marks=pytest.mark.skipif(not amx_codes_supported(),
                                                              reason=needs("amx"))),
    pytest.param("linear_dequant_amx", marks=pytest.mark.skipif(not amx_codes_supported(),
                                                                reason=needs("amx"))),
]


@dataclass
class Kernel:
    op: object  # out, x, codes, scales, mins, bias
    bf16_weights: bool  # multiplies by bf16(w), not by w

    def __call__(self, *args) -> None:
        self.op(*args)

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """The weight this kernel's exact product uses."""
        return w.to(torch.bfloat16).float() if self.bf16_weights else w


@pytest.fixture(params=KERNELS)
def kernel(request) -> Kernel:
    return Kernel(getattr(cpu_kernels.load(), request.param), request.param == "linear_dequant_amx")


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


# N 50: a ragged last panel (and an odd number of panels: linear_dequant_amx's pairs); rows 1-19 cover
# every tile height of the dot kernel (8-row tiles and the remainder), 16-65 the AMX kernels' whole and
# padded groups of 16 and pairs of groups; K 96 (an odd number of 32-blocks) and
# 576 (SmolLM2's hidden size).
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(50, 96), (64, 576)])
def test_kernel_gives_the_exact_product_rounded(kernel, kind: str, n: int, k: int) -> None:
    w = quantized_weight(n, k, kind, seed=n + k)
    packed = codes_weight(w, nibbles=True)
    assert packed is not None and packed.codes.dtype == (torch.uint8 if kind == "q4_1" else torch.int8)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 7, 8, 9, 16, 19, 32, 33, 64, 65):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            for dtype in (torch.bfloat16, torch.float32):
                out = torch.full((rows, n), float("nan"), dtype=dtype)
                kernel(out, x, packed.codes, packed.scales, packed.mins, b)
                _check(out, x, kernel.weight(w), b)


@pytest.mark.parametrize("rows", [11, 32, 45])  # padded groups of 16 (AMX) and whole ones
def test_rows_a_stride_apart_and_a_rows_result_does_not_depend_on_the_batch(kernel, rows: int) -> None:
    w = quantized_weight(40, 128, "q4_1", seed=3)
    packed = codes_weight(w)
    wide = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = wide[:, :128]  # rows 256 elements apart
    out = torch.empty(rows, 40, dtype=torch.bfloat16)
    kernel(out, x, packed.codes, packed.scales, packed.mins, None)
    _check(out, x, kernel.weight(w), None)
    for r in (0, 9, rows - 1):  # the row repeated 4 times: the same sums as among the others
        one = torch.empty(4, 40, dtype=torch.bfloat16)
        kernel(one, x[[r] * 4].contiguous(), packed.codes, packed.scales, packed.mins, None)
        assert torch.equal(one[0], out[r]) and torch.equal(one[3], out[r])


def test_int8_and_nibble_codes_give_the_same_results(kernel) -> None:
    w = quantized_weight(48, 192, "q4_1", seed=4)
    nib, byte = codes_weight(w, nibbles=True), codes_weight(w, nibbles=False)
    assert torch.equal(nib.codes, nibble_codes(byte.codes))
    x = torch.randn(5, 192).to(torch.bfloat16)
    outs = []
    for p in (nib, byte):
        out = torch.empty(5, 48, dtype=torch.float32)
        kernel(out, x, p.codes, p.scales, p.mins, None)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_fp16_scales_and_mins_give_the_same_bits(kernel) -> None:
    # GGUF's Q4_1 blocks as llama.cpp's quantizer writes them: the block's smallest weight is code 0, so
    # its min is the fp16 m itself (a block without a 0 code has min d c0 + m, seldom an fp16 value).
    g = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (48, 6, 32), generator=g).double()
    q[..., 0] = 0
    d = (torch.rand(48, 6, 1, generator=g) * 0.02 + 1e-3).half().double()
    m = (-torch.rand(48, 6, 1, generator=g) * 0.1).half().double()
    w = (d * q + m).float().reshape(48, 192)
    wide, narrow = codes_weight(w), bf16_codes_weight(w)
    assert wide.scales.dtype == torch.float32 and narrow.scales.dtype == narrow.mins.dtype == torch.float16
    assert narrow.nbytes < wide.nbytes
    for rows in (1, 5, 17):
        x = torch.randn(rows, 192, generator=g).to(torch.bfloat16)
        outs = []
        for p in (wide, narrow):
            out = torch.empty(rows, 48, dtype=torch.float32)
            kernel(out, x, p.codes, p.scales, p.mins, None)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
    # One block whose min is no fp16 value (still exact integer blocks): the whole weight keeps fp32.
    m[0, 0] += 2.0**-20
    odd = bf16_codes_weight((d * q + m).float().reshape(48, 192))
    assert odd is not None and odd.scales.dtype == odd.mins.dtype == torch.float32


def test_wrong_arguments_are_refused_with_what_was_expected(kernel) -> None:
    packed = codes_weight(quantized_weight(32, 64, "q4_1", seed=5))
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        kernel(torch.empty(2, 32), x.float(), packed.codes, packed.scales, packed.mins, None)
    with pytest.raises(RuntimeError, match="out must be 2-D bfloat16 or float32"):
        kernel(torch.empty(2, 32, dtype=torch.float16), x, packed.codes, packed.scales, packed.mins, None)
    with pytest.raises(RuntimeError, match="out has 40 columns, the codes 2 panels of 16"):
        kernel(torch.empty(2, 40), x, packed.codes, packed.scales, packed.mins, None)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[32\]"):
        kernel(torch.empty(2, 32), x, packed.codes, packed.scales, packed.mins, torch.zeros(31))
    with pytest.raises(RuntimeError, match="scales and mins are both float32 or both float16"):
        kernel(torch.empty(2, 32), x, packed.codes, packed.scales.half(), packed.mins, None)
