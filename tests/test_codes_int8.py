"""Integer-code linears with int8 activations (kernels/csrc/cpu_codes_int8.cpp, `--int8-activations`).

The kernel is not bit-exact with the fp32 weights by design: it rounds each row's x to int8 per 32 k. So
it is checked two ways: against the same arithmetic written out in torch in float64 (a defined result, to
fp32 rounding), and against the exact fp32 product within the bound that rounding x allows.
"""

import pytest
import torch
from tokenmill.engine.layers.cpu_gemm_policy import CPU_PACKED_MAX_ROWS, fp32_linear_ops, int8x_bf16_supported
from tokenmill.kernels.cpu_probe import needs

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    fp32_linear_ops(CPU, torch.float32) is None, reason=f"{needs('avx2')} (or the C++ kernels did not build)"
)


def _panels(n: int, k: int, nibbles: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random code panels as the kernels take them, every code value included (int8 -128..127)."""
    g = torch.Generator().manual_seed(seed)
    p = (n + 15) // 16
    if nibbles:
        codes = torch.randint(0, 256, (p, k // 2, 16), generator=g, dtype=torch.int32).to(torch.uint8)
        codes[0, 0, 0] = 0xFF  # both nibbles at 15
    else:
        codes = torch.randint(-128, 128, (p, k, 16), generator=g, dtype=torch.int32).to(torch.int8)
        codes[0, :32, 0] = -128  # |q| = 128 against x = +-127: the largest pair sum
    scales = torch.rand(p, k // 32, 16, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(p, k // 32, 16, generator=g) * 0.1 if nibbles else torch.zeros(p, k // 32, 16)
    return codes, scales, mins


def _weights(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int):
    """(q, d, m) per weight as float64 [n, K], from the panels."""
    if codes.dtype == torch.uint8:
        low, high = (codes & 0x0F).to(torch.int16), (codes >> 4).to(torch.int16)
        q = torch.stack((low, high), dim=2).reshape(codes.shape[0], -1, 16)  # k = 2j low, 2j + 1 high
    else:
        q = codes.to(torch.int16)
    q = q.permute(0, 2, 1).reshape(-1, q.shape[1])[:n].double()
    d = scales.permute(0, 2, 1).reshape(-1, scales.shape[1])[:n].double().repeat_interleave(32, dim=1)
    m = mins.permute(0, 2, 1).reshape(-1, mins.shape[1])[:n].double().repeat_interleave(32, dim=1)
    return q, d, m


def _reference(x: torch.Tensor, codes, scales, mins, n: int, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's arithmetic in float64, the bound on its distance from the exact fp32 product)."""
    return _reference_qdm(x, *_weights(codes, scales, mins, n), bias)


def _reference_qdm(x: torch.Tensor, q, d, m, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """_reference for weights w = d * q + m given per weight (float64 [n, K]; d and m constant per 32 k)."""
    rows, k = x.shape
    n = q.shape[0]
    blocks = x.view(rows, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))  # fp32, as the kernel
    xq = torch.clamp(torch.round(blocks * inv), -127, 127).double()  # round: ties to even, as nearbyint
    dx = (amax / 127.0).double()
    qb, db, mb = (t.view(n, k // 32, 32) for t in (q, d, m))
    isum = torch.einsum("rbi,nbi->rnb", xq, qb)  # exact: integers below 2^53
    step = db[:, :, 0][None] * dx[:, :, 0][:, None]
    y = (step * isum).sum(-1) + (mb[:, :, 0][None] * blocks.sum(-1).double()[:, None]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    bound = ((qb * db).abs()[None] * dx[:, None] / 2).sum(dim=(-1, -2))
    return y, bound


@pytest.mark.parametrize(
    "n,k,nibbles", [(50, 96, True), (64, 1056, False), (33, 576, True), (16, 32, False), (300, 64, True)]
)  # 300: 19 panels, past the 8 a tile of rows passes over together, the last ragged
def test_int8_activations_follow_their_arithmetic_and_stay_within_the_rounding_bound(
    n: int, k: int, nibbles: bool
) -> None:
    ops = fp32_linear_ops(CPU, torch.float32)
    codes, scales, mins = _panels(n, k, nibbles, seed=n + k)
    g = torch.Generator().manual_seed(5)
    b = torch.randn(n, generator=g)
    q, d, m = _weights(codes, scales, mins, n)
    w = (d * q + m).float()  # the exact weights the codes stand for
    for rows in (1, 3, 4, 5, 16, 37):  # 37: more rows than the engine sends it (16), which the kernel takes
        x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 10.0, k)  # blocks of different scales
        x[0, 32:64] = 0.0  # an all-zero block (where K has two): dx = 0, no division by zero
        for bias in (None, b):
            got = torch.empty(rows, n)
            ops.linear_codes_int8x(got, x, codes, scales, mins, bias)
            ref, bound = _reference(x, codes, scales, mins, n, bias)
            magnitude = (x.double().abs() @ (d * q.abs() + m.abs()).T).clamp_min(1.0)
            assert ((got.double() - ref).abs() <= 1e-5 * magnitude).all()
            exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert ((got.double() - exact).abs() <= bound + 1e-5 * magnitude).all()
            # and the rounding is visible: this is not the exact kernel under another name
            assert not torch.equal(got, exact.float())


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    ops = fp32_linear_ops(CPU, torch.float32)
    codes, scales, mins = _panels(40, 576, True, seed=3)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(4))
    full = torch.empty(9, 40)
    ops.linear_codes_int8x(full, x, codes, scales, mins, None)
    for i in (0, 3, 4, 8):
        one = torch.empty(1, 40)
        ops.linear_codes_int8x(one, x[i : i + 1].clone(), codes, scales, mins, None)
        assert torch.equal(full[i : i + 1], one)


def test_bad_arguments_name_the_problem() -> None:
    ops = fp32_linear_ops(CPU, torch.float32)
    codes, scales, mins = _panels(16, 64, True, seed=1)
    with pytest.raises(RuntimeError, match="K=96"):
        ops.linear_codes_int8x(torch.empty(1, 16), torch.randn(1, 96), codes, scales, mins, None)
    bf16 = torch.randn(1, 64).bfloat16()
    if int8x_bf16_supported():  # the VNNI tiles take bf16 rows, writing bf16 or fp32, not fp16
        with pytest.raises(RuntimeError, match="bfloat16"):
            ops.linear_codes_int8x(torch.empty(1, 16, dtype=torch.float16), bf16, codes, scales, mins, None)
    else:
        with pytest.raises(RuntimeError, match="float32"):
            ops.linear_codes_int8x(torch.empty(1, 16), bf16, codes, scales, mins, None)
    with pytest.raises(RuntimeError, match="float16"):  # scales and mins of one dtype
        ops.linear_codes_int8x(torch.empty(1, 16), torch.randn(1, 64), codes, scales.half(), mins, None)


# The VNNI tiles (AVX-512 VNNI + VBMI builds) also take bf16 rows: a bf16 model's `--int8-activations`.
vnni = pytest.mark.skipif(not int8x_bf16_supported(), reason="needs a CPU with AVX-512 VNNI and VBMI (the kernels' VNNI tiles)")


@vnni
@pytest.mark.parametrize("n,k,nibbles", [(50, 96, True), (300, 576, True), (64, 1056, False), (40, 64, False)])
def test_bf16_rows_give_the_fp32_rows_sums_rounded_once(n: int, k: int, nibbles: bool) -> None:
    """bf16 x is widened exactly, so the fp32 sums equal those of x.float() bit for bit, and a bf16 out is them
    rounded once; with the bf16 kernels' fp16 scales and mins (every value an fp16) the same again."""
    ops = fp32_linear_ops(CPU, torch.float32)
    codes, scales, mins = _panels(n, k, nibbles, seed=n * k)
    scales, mins = scales.half().float(), mins.half().float()
    g = torch.Generator().manual_seed(11)
    b = torch.randn(n, generator=g)
    for rows in (1, 2, 5, 6, 7, 13, 64):  # tiles of 1-6 rows; 19 panels: pairs and a last one alone, ragged
        x = (torch.randn(rows, k, generator=g) * torch.linspace(0.1, 10.0, k)).bfloat16()
        for bias in (None, b):
            want = torch.empty(rows, n)
            ops.linear_codes_int8x(want, x.float(), codes, scales, mins, bias)
            ref, _ = _reference(x.float(), codes, scales, mins, n, bias)
            magnitude = (x.double().abs() @ _magnitude(codes, scales, mins, n).T).clamp_min(1.0)
            assert ((want.double() - ref).abs() <= 1e-5 * magnitude).all()
            for s, m in ((scales, mins), (scales.half(), mins.half())):
                wide = torch.empty(rows, n)
                ops.linear_codes_int8x(wide, x, codes, s, m, bias)
                assert torch.equal(wide, want)
                narrow = torch.empty(rows, n, dtype=torch.bfloat16)
                ops.linear_codes_int8x(narrow, x, codes, s, m, bias)
                assert torch.equal(narrow, want.bfloat16())


def _magnitude(codes, scales, mins, n: int) -> torch.Tensor:
    q, d, m = _weights(codes, scales, mins, n)
    return d * q.abs() + m.abs()


@vnni
def test_grouped_weights_take_bf16_rows_too() -> None:
    ops = fp32_linear_ops(CPU, torch.float32)
    w = _grouped("Q4_K", 200, 512)
    x = (torch.randn(9, 512, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    want = torch.empty(9, 200)
    ops.linear_grouped_int8x(want, x.float(), w.lo, w.hi, w.sc, w.mn, w.d, w.dmin, w.fmt_list, None)
    got = torch.empty(9, 200, dtype=torch.bfloat16)
    ops.linear_grouped_int8x(got, x, w.lo, w.hi, w.sc, w.mn, w.d, w.dmin, w.fmt_list, None)
    assert torch.equal(got, want.bfloat16())
    w.int8_x = True  # bf16 rows take it at every batch size (linear() above 16 rows too)
    x40 = x.repeat(5, 1)[:40]
    ref = torch.empty(40, 200)
    ops.linear_grouped_int8x(ref, x40.float(), w.lo, w.hi, w.sc, w.mn, w.d, w.dmin, w.fmt_list, None)
    assert torch.equal(w.linear(x40), ref.bfloat16())


def _grouped(type_name: str, n: int, k: int):
    """A random weight in the grouped layout: a GGUF type quantized by the gguf package, or "int4" (AWQ /
    GPTQ: sc = 1, mn = the zero point, d = dmin = the group's scale, group 128)."""
    from tokenmill.engine.layers.grouped_codes import GroupedPackedWeight
    from tokenmill.engine.quant_memory import GROUPED_GGUF, int4_group_format

    g = torch.Generator().manual_seed(n + k)
    p = (n + 15) // 16
    if type_name == "int4":
        s = (torch.rand(p, k // 128, 16, generator=g) * 0.01 + 1e-3).half()
        return GroupedPackedWeight(
            n, int4_group_format(128), torch.randint(0, 256, (p, k // 2, 16), generator=g, dtype=torch.int32).to(torch.uint8),
            torch.empty(p, k // 2, 0, dtype=torch.int32), torch.ones(p, k // 32, 16, dtype=torch.int8),
            torch.randint(0, 16, (p, k // 32, 16), generator=g, dtype=torch.int32).to(torch.int8), s, s.clone(),
        )  # fmt: skip
    import numpy as np
    from tokenmill.engine.bench.gguf_quantize import quantize
    from tokenmill.engine.model.gguf_weights import _grouped_panels

    raw = quantize(torch.randn(n, k, generator=g).numpy().astype(np.float32) * 0.05, type_name)
    a = {name: torch.from_numpy(v) for name, v in _grouped_panels(type_name, raw).items()}
    e8, e16 = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.float16)
    return GroupedPackedWeight(n, GROUPED_GGUF[type_name], a["lo"], a["hi"].view(torch.int32), a["sc"],
                               a.get("mn", e8), a["d"], a.get("dmin", e16))  # fmt: skip


def _grouped_qdm(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) per weight, float64 [n, K], of a 4-bit grouped weight: w = (d sc) q - dmin mn."""
    from tokenmill.engine.layers.grouped_codes import grouped_codes

    def rows(t: torch.Tensor, per: int) -> torch.Tensor:  # [P, C, 16] -> [n, C * per]
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: w.out_features].double().repeat_interleave(per, dim=1)

    fmt = w.fmt
    q = grouped_codes(w)[: w.out_features].double()
    d = rows(w.d, fmt.group) * rows(w.sc, fmt.block)
    m = -(rows(w.dmin, fmt.group) * rows(w.mn, fmt.block))
    return q, d, m


@pytest.mark.parametrize("type_name", ["Q4_K", "int4"])
def test_grouped_4bit_weights_take_int8_activations_with_the_same_arithmetic(type_name: str) -> None:
    """Q4_K and AWQ / GPTQ int4 (the grouped layout, cpu_grouped.cpp): the same kernel, with each block's scale
    d * sc and min -dmin * mn computed from the file's codes."""
    ops = fp32_linear_ops(CPU, torch.float32)
    n, k = 200, 512  # 13 panels, the last ragged
    w = _grouped(type_name, n, k)
    q, d, m = _grouped_qdm(w)
    assert torch.equal((d * q + m).float(), w.dequantize())  # the decomposition the reference relies on
    g = torch.Generator().manual_seed(9)
    bias = torch.randn(n, generator=g)
    for rows in (1, 6, 40):
        x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 10.0, k)
        got = torch.empty(rows, n)
        ops.linear_grouped_int8x(got, x, w.lo, w.hi, w.sc, w.mn, w.d, w.dmin, w.fmt_list, bias)
        ref, bound = _reference_qdm(x, q, d, m, bias)
        magnitude = (x.double().abs() @ (d.abs() * q.abs() + m.abs()).T).clamp_min(1.0)
        assert ((got.double() - ref).abs() <= 1e-5 * magnitude).all()
        exact = w.linear(x, bias)  # the exact grouped kernel
        assert ((got.double() - exact.double()).abs() <= bound + 1e-5 * magnitude).all()
        assert not torch.equal(got, exact)
        w.int8_x = True  # what --int8-activations sets: linear() takes this kernel up to 16 rows, as for codes
        assert torch.equal(w.linear(x, bias), got if rows <= CPU_PACKED_MAX_ROWS else exact)
        w.int8_x = False


def test_grouped_formats_without_an_int8_form_are_refused_by_name() -> None:
    ops = fp32_linear_ops(CPU, torch.float32)
    w = _grouped("Q6_K", 16, 256)
    assert not w.int8x_supported
    with pytest.raises(RuntimeError, match="bits=6 block=16 offset=32"):
        ops.linear_grouped_int8x(torch.empty(1, 16), torch.randn(1, 256), w.lo, w.hi, w.sc, w.mn, w.d, w.dmin,
                                 w.fmt_list, None)  # fmt: skip
