"""The fp32 packed-weight linear kernel (kernels/csrc/cpu_linear.cpp) against a float64 product.

The model-level proof (greedy tokens and logits against transformers with every projection on this
kernel) is in test_model_llama.py; these cases cover the shapes a model does not: ragged last panels,
odd K, every row-tile remainder, row blocks, bias, and the argument checks.
"""

import pytest
import torch
import torch.nn.functional as F
from tokenmill.engine.layers.cpu_gemm_policy import CPU_PACKED_MAX_ROWS, fp32_linear_ops
from tokenmill.engine.layers.linear import Linear, pack_cpu_weight
from tokenmill.engine.layers.weight_codes import find_weight_codes
from tokenmill.kernels.cpu_probe import needs

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    fp32_linear_ops(CPU, torch.float32) is None, reason=f"{needs('avx2')} (or the C++ kernels did not build)"
)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("n,k", [(960, 576), (50, 37), (16, 1), (17, 1536), (7, 64)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 97, 200])
def test_packed_linear_matches_a_float64_product(n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    packed = pack_cpu_weight(w, blocks=False)
    assert packed.fp32.shape == (-(-n // 16), k, 16)
    for bias in (None, b):
        got = packed.linear(x, bias)
        ref = _reference(x, w, bias)
        # One fp32 sum of k products: its rounding error grows with k and the terms' size.
        bound = 1e-6 * (k**0.5) * (x.abs().double() @ w.abs().double().T + 1)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert ((got.double() - ref).abs() <= bound).all()
        # torch's fp32 GEMM is held to the same bound, so the bound is not loose by construction.
        assert ((F.linear(x, w, bias).double() - ref).abs() <= bound).all()


def test_rows_with_a_stride_and_leading_dims_are_read_correctly() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    wide = torch.randn(9, 48, generator=g)
    x = wide[:, :24]  # rows 48 apart
    packed = pack_cpu_weight(w, blocks=False)
    torch.testing.assert_close(packed.linear(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 24, generator=g)
    got = packed.linear(x3)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, F.linear(x3, w), rtol=1e-5, atol=1e-5)


def test_linear_module_runs_small_batches_packed_and_large_ones_through_torch() -> None:
    g = torch.Generator().manual_seed(2)
    lin = Linear(576, 192, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(192, 576, generator=g))
        lin.bias.copy_(torch.randn(192, generator=g))
    lin.pack_cpu()
    assert lin.packed_cpu is not None and lin.packed_cpu.fp32 is not None
    for rows in (1, CPU_PACKED_MAX_ROWS, CPU_PACKED_MAX_ROWS + 1, 100):
        x = torch.randn(rows, 576, generator=g)
        got = lin(x)
        assert (got.double() - _reference(x, lin.weight, lin.bias)).abs().max() < 1e-4
        packed = lin.packed_cpu.linear(x, lin.bias)
        assert torch.equal(got, packed) == (rows <= CPU_PACKED_MAX_ROWS)  # which path ran


@pytest.mark.parametrize("n,k", [(960, 576), (50, 37), (17, 1536)])
def test_a_bf16_checkpoints_weight_packs_to_bf16_panels_with_the_fp32_panels_sums(n: int, k: int) -> None:
    """A weight whose every fp32 value is a bf16 value (a bf16 checkpoint served in fp32) is packed as bf16
    panels, half the bytes, and every batch size sums exactly what fp32 panels of it sum."""
    ops = fp32_linear_ops(CPU, torch.float32)
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    b = torch.randn(n, generator=g)
    half, full = pack_cpu_weight(w, blocks=False), ops.pack_linear_weight(w, False)
    assert half.fp32.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert half.nbytes * 2 == full.numel() * full.element_size() and torch.equal(half.fp32.float(), full)
    for rows in (1, 5, 6, 7, 16, 97, 200):  # in-register widening up to one tile, widened panels past it
        x = torch.randn(rows, k, generator=g)
        for bias in (None, b):
            want = torch.empty(rows, n)
            ops.linear_packed(want, x, full, bias)
            assert torch.equal(half.linear(x, bias), want), rows
    # One bit below bf16's precision in one weight keeps the whole weight in fp32 panels.
    w[n // 2, k // 2] = torch.nextafter(w[n // 2, k // 2], torch.tensor(float("inf")))
    assert pack_cpu_weight(w, blocks=False).fp32.dtype == torch.float32


def test_a_bf16_exact_linear_and_tied_embedding_drop_their_fp32_copy() -> None:
    """bf16 panels run every batch (no fp32 matrix kept for torch's GEMM) and give embedding rows."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 576, generator=g).bfloat16().float()
    lin = Linear(576, 200, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    assert lin.pack_cpu() and lin.weight is None and lin.packed_cpu.stands_alone
    for rows in (1, CPU_PACKED_MAX_ROWS + 1, 100):
        x = torch.randn(rows, 576, generator=g)
        bound = 1e-6 * (576**0.5) * (x.abs().double() @ w.abs().double().T + 1)  # as in the first test
        assert ((lin(x).double() - _reference(x, w, None)).abs() <= bound).all()
    ids = torch.tensor([0, 199, 16, 15, 77])
    assert torch.equal(lin.packed_cpu.embedding(ids), w[ids])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 200\)"):
        lin.packed_cpu.embedding(torch.tensor([200]))


def test_wrong_shapes_are_refused_with_the_sizes() -> None:
    ops = fp32_linear_ops(CPU, torch.float32)
    packed = pack_cpu_weight(torch.randn(32, 24), blocks=False).fp32
    with pytest.raises(RuntimeError, match=r"K=20"):
        ops.linear_packed(torch.empty(2, 32), torch.randn(2, 20), packed, None)
    with pytest.raises(RuntimeError, match="out has 48 columns"):
        ops.linear_packed(torch.empty(2, 48), torch.randn(2, 24), packed, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.pack_linear_weight(torch.randn(32, 24).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[32\]"):
        ops.linear_packed(torch.empty(2, 32), torch.randn(2, 24), packed, torch.randn(31))


def test_the_switch_turns_the_kernel_off(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_CPU_LINEAR", "0")
    assert fp32_linear_ops(CPU, torch.float32) is None
    monkeypatch.delenv("TOKENMILL_CPU_LINEAR")
    assert fp32_linear_ops(CPU, torch.float32) is not None
    assert fp32_linear_ops(CPU, torch.bfloat16) is None  # bf16 stays on oneDNN / F.linear


def _gguf_like(n: int, k: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """An fp32 weight as gguf dequantizes one: fp16 scale (and min) per 32 weights of a row."""
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).to(torch.float16).double()
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).double()
        m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).to(torch.float16).double()
    else:  # q8_0
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).double()
        q[..., 5] = 127  # llama.cpp's Q8_0 scale is the block's largest |weight| / 127
        m = torch.zeros(n, k // 32, 1, dtype=torch.float64)
    return (d * q + m).to(torch.float32).reshape(n, k)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_integer_blocks_rebuild_the_weight_and_give_the_panels_result_bit_for_bit(kind: str) -> None:
    g = torch.Generator().manual_seed(5)
    w = _gguf_like(50, 96, kind, g)
    found = find_weight_codes(w)
    assert found is not None
    rebuilt = found.scales.repeat_interleave(32, 1).double() * found.codes.double()
    rebuilt += found.mins.repeat_interleave(32, 1).double()
    assert torch.equal(rebuilt.to(torch.float32), w)
    blocks, panels = pack_cpu_weight(w, blocks=True), pack_cpu_weight(w, blocks=False)
    assert blocks.codes is not None and panels.fp32 is not None
    assert blocks.nbytes < 0.35 * panels.nbytes
    b = torch.randn(50, generator=g)
    for rows in (1, 3, 4, 5, 64, 97):
        x = torch.randn(rows, 96, generator=g)
        assert torch.equal(blocks.linear(x, b), panels.linear(x, b))
        assert ((blocks.linear(x).double() - _reference(x, w, None)).abs() < 1e-4).all()


def test_weights_without_an_exact_block_form_stay_fp32() -> None:
    g = torch.Generator().manual_seed(6)
    assert find_weight_codes(torch.randn(64, 96, generator=g)) is None  # never quantized
    w = _gguf_like(64, 96, "q4_1", g)
    assert find_weight_codes(w) is not None
    w[10, 40] = torch.nextafter(w[10, 40], torch.tensor(1.0))  # one weight off by one ulp
    assert find_weight_codes(w) is None
    assert pack_cpu_weight(w).fp32 is not None
    assert find_weight_codes(torch.zeros(8, 33)) is None  # K not a multiple of 32


def test_kernels_run_on_torchs_openmp_threads_and_results_do_not_depend_on_them() -> None:
    # at::parallel_for is a serial loop in code built without OpenMP: the library must call the OpenMP
    # runtime, and the one torch loaded (a second runtime would keep its own thread count).
    import pathlib
    import re

    maps = pathlib.Path("/proc/self/maps").read_text()
    libs = set(re.findall(r"\S*/tokenmill_cpu_\w+\.so", maps))
    assert len(libs) == 1, libs
    assert b"GOMP_parallel" in pathlib.Path(libs.pop()).read_bytes()
    assert len(set(re.findall(r"\S*libgomp[^\s/]*\.so[.\d]*", maps))) == 1
    g = torch.Generator().manual_seed(7)
    w = _gguf_like(200, 576, "q4_1", g)
    blocks = pack_cpu_weight(w, blocks=True)
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 8, 40):
            x = torch.randn(rows, 576, generator=g)
            torch.set_num_threads(1)
            one = blocks.linear(x)
            torch.set_num_threads(2)
            assert torch.equal(blocks.linear(x), one)
    finally:
        torch.set_num_threads(before)
