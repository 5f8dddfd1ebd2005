"""The large-batch q8 kernel and the embedding lookup from codes (kernels/csrc/cpu_gemm.cpp).

Both must give exactly what the small-batch kernel (cpu_linear.cpp) and the fp32 weights give: the
kernel sums every output in the same order with the same rebuilt weights, and the lookup rebuilds the
loaded fp32 rows. So these tests use torch.equal, not a tolerance.
"""

import pytest
import torch
from quantized_weights import quantized_weight
from tokenmill.engine.layers.cpu_gemm_policy import CPU_PACKED_MAX_ROWS, fp32_linear_ops
from tokenmill.engine.layers.linear import Linear, pack_cpu_weight
from tokenmill.engine.models.llama import VocabParallelEmbedding
from tokenmill.kernels.cpu_probe import needs

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    fp32_linear_ops(CPU, torch.float32) is None, reason=f"{needs('avx2')} (or the C++ kernels did not build)"
)


def _gemm(packed, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.out_features)
    fp32_linear_ops(CPU, torch.float32).linear_q8_gemm(out, x, packed.codes, packed.scales, packed.mins, bias)
    return out


# N 50 and 33: a ragged last panel; K 1056 crosses the kernel's 1024-deep K block, and with it 301 rows
# cross its 256-row block (1 MB of x) and leave a 1-row tile (301 = 50 * 6 + 1).
@pytest.mark.parametrize("n,k,kind", [(50, 96, "q4_1"), (64, 1056, "q8_0"), (33, 576, "q4_1")])
def test_gemm_equals_the_small_batch_kernel_and_the_fp32_panels(n: int, k: int, kind: str) -> None:
    w = quantized_weight(n, k, kind, seed=n + k)
    blocks, panels = pack_cpu_weight(w, blocks=True), pack_cpu_weight(w, blocks=False)
    assert blocks.codes is not None and panels.fp32 is not None
    g = torch.Generator().manual_seed(7)
    b = torch.randn(n, generator=g)
    ops = fp32_linear_ops(CPU, torch.float32)
    for rows in (1, 5, 6, 7, 17, 100, 301):
        x = torch.randn(rows, k, generator=g)
        for bias in (None, b):
            got = _gemm(blocks, x, bias)
            small = torch.empty_like(got)
            ops.linear_packed_q8(small, x, blocks.codes, blocks.scales, blocks.mins, bias)
            assert torch.equal(got, small)
            assert torch.equal(got, panels.linear(x, bias))
    # torch's GEMM on the same fp32 weight agrees to rounding (a different summation order).
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    w = quantized_weight(40, 1056, "q4_1", seed=3)
    packed = pack_cpu_weight(w, blocks=True)
    x = torch.randn(300, 1056, generator=torch.Generator().manual_seed(4))
    full = _gemm(packed, x)
    for i in (0, 5, 6, 255, 256, 299):
        assert torch.equal(full[i : i + 1], _gemm(packed, x[i : i + 1].clone()))
    strided = torch.randn(300, 2048, generator=torch.Generator().manual_seed(4))[:, :1056]  # rows 2048 apart
    assert torch.equal(_gemm(packed, strided), _gemm(packed, strided.contiguous()))


def test_gemm_refuses_wrong_arguments_with_the_sizes() -> None:
    ops = fp32_linear_ops(CPU, torch.float32)
    packed = pack_cpu_weight(quantized_weight(32, 64, "q4_1", seed=5), blocks=True)
    c, s, m = packed.codes, packed.scales, packed.mins
    with pytest.raises(RuntimeError, match=r"codes are int8 \[panels, K=96, 16\]"):
        ops.linear_q8_gemm(torch.empty(2, 32), torch.randn(2, 96), c, s, m, None)
    with pytest.raises(RuntimeError, match="out has 48 columns, the codes 2 panels of 16"):
        ops.linear_q8_gemm(torch.empty(2, 48), torch.randn(2, 64), c, s, m, None)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[32\]"):
        ops.linear_q8_gemm(torch.empty(2, 32), torch.randn(2, 64), c, s, m, torch.randn(31))
    with pytest.raises(RuntimeError, match=r"scales and mins are float32 \[2, 2, 16\]"):
        ops.linear_q8_gemm(torch.empty(2, 32), torch.randn(2, 64), c, s[:1].contiguous(), m, None)
    with pytest.raises(RuntimeError, match="x must be 2-D float32"):
        ops.linear_q8_gemm(torch.empty(2, 32), torch.randn(2, 64).double(), c, s, m, None)
    with pytest.raises(RuntimeError, match="out must be 2-D float32"):
        ops.linear_q8_gemm(torch.empty(3, 32), torch.randn(2, 64), c, s, m, None)


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_embedding_from_codes_gives_the_fp32_rows(kind: str) -> None:
    vocab, hidden = 101, 96  # 101: a ragged last panel
    w = quantized_weight(vocab, hidden, kind, seed=8)
    packed = pack_cpu_weight(w, blocks=True, nibbles=False)
    ops = fp32_linear_ops(CPU, torch.float32)
    ids = torch.tensor([0, 100, 15, 16, 17, 3, 3, 99])
    out = torch.empty(len(ids), hidden)
    ops.embedding_q8(out, ids, packed.codes, packed.scales, packed.mins, vocab)
    assert torch.equal(out, w[ids])
    every = torch.empty(vocab, hidden)
    ops.embedding_q8(every, torch.arange(vocab), packed.codes, packed.scales, packed.mins, vocab)
    assert torch.equal(every, w)
    with pytest.raises(RuntimeError, match=r"id 101 is outside the vocabulary \[0, 101\)"):
        ops.embedding_q8(
            torch.empty(1, hidden), torch.tensor([101]), packed.codes, packed.scales, packed.mins, vocab
        )
    with pytest.raises(RuntimeError, match=r"id -1 is outside"):
        ops.embedding_q8(
            torch.empty(1, hidden), torch.tensor([-1]), packed.codes, packed.scales, packed.mins, vocab
        )
    with pytest.raises(RuntimeError, match="num_rows=120 does not fit 7 panels of 16"):
        ops.embedding_q8(
            torch.empty(1, hidden), torch.tensor([0]), packed.codes, packed.scales, packed.mins, 120
        )
    with pytest.raises(RuntimeError, match=r"out must be contiguous float32 \[1, 96\]"):
        ops.embedding_q8(
            torch.empty(1, 95), torch.tensor([0]), packed.codes, packed.scales, packed.mins, vocab
        )


def test_a_linear_on_integer_blocks_drops_its_fp32_weight_and_runs_every_batch_from_codes() -> None:
    w = quantized_weight(50, 96, "q4_1", seed=9)
    g = torch.Generator().manual_seed(10)
    b = torch.randn(50, generator=g)
    dropped, kept = Linear(96, 50, bias=True), Linear(96, 50, bias=True)
    for lin in (dropped, kept):
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    dropped.pack_cpu()
    kept.pack_cpu(keep_fp32=True)  # as under tensor parallelism
    assert dropped.weight is None and dropped.packed_cpu.codes is not None
    assert kept.weight is not None
    ops = fp32_linear_ops(CPU, torch.float32)
    for rows in (1, CPU_PACKED_MAX_ROWS, CPU_PACKED_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 96, generator=g)
        small = torch.empty(rows, 50)
        ops.linear_packed_q8(
            small, x, dropped.packed_cpu.codes, dropped.packed_cpu.scales, dropped.packed_cpu.mins, b
        )
        assert torch.equal(dropped(x), small)
        # With the fp32 weight kept, batches past the small-batch kernel still go to torch's GEMM.
        expect = small if rows <= CPU_PACKED_MAX_ROWS else torch.nn.functional.linear(x, w, b)
        assert torch.equal(kept(x), expect)


def test_a_tied_embedding_without_its_fp32_matrix_looks_rows_up_in_the_codes() -> None:
    w = quantized_weight(70, 64, "q8_0", seed=11)
    emb = VocabParallelEmbedding(70, 64)
    with torch.no_grad():
        emb.weight.copy_(w)
    ids = torch.tensor([69, 0, 16, 16, 33], dtype=torch.int64)
    expect = emb(ids)
    emb.packed_cpu, emb.weight = pack_cpu_weight(w, blocks=True, nibbles=False), None
    assert torch.equal(emb(ids), expect)
    assert torch.equal(emb(ids.int()), expect)


def test_the_bundled_model_keeps_no_fp32_copy_of_its_quantized_weights(bundled_model_dir) -> None:
    from tokenmill.engine.model.loader import load_model
    from tokenmill.engine.model_config import load_model_config

    config = load_model_config(bundled_model_dir)
    model = load_model(bundled_model_dir, config, torch.float32, "cpu")
    ids = torch.tensor([1, 500, 49151])
    rows = model.model.embed_tokens(ids)
    model.pack_linears_cpu()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down per layer (tied LM head)
    assert all(m.weight is None and m.packed_cpu.codes is not None for m in linears)
    assert model.model.embed_tokens.weight is None and model.lm_head_packed_cpu.codes is not None
    assert torch.equal(model.model.embed_tokens(ids), rows)
    # What stays for the linears: 1.25 bytes per weight plus the per-panel padding.
    weights = sum(m.in_features * m.out_features for m in linears) + config.vocab_size * config.hidden_size
    packed = sum(m.packed_cpu.nbytes for m in linears) + model.lm_head_packed_cpu.nbytes
    assert packed < 1.3 * weights


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 301])
def test_nibble_codes_give_the_int8_codes_results_bit_for_bit(rows: int) -> None:
    # Q4_1 codes (0..15) are packed two to a byte: every batch path (the small-batch tiles, the rebuilt
    # panel past 4 rows, the GEMM past 16) reads them and must sum the same weights in the same order.
    w = quantized_weight(50, 1056, "q4_1", seed=11)  # a ragged last panel; K crosses the GEMM's 1024-deep block
    nib, int8 = pack_cpu_weight(w, blocks=True), pack_cpu_weight(w, blocks=True, nibbles=False)
    assert nib.codes.dtype == torch.uint8 and nib.codes.shape == (4, 528, 16) and int8.codes.dtype == torch.int8
    assert nib.nbytes < 0.65 * int8.nbytes
    ops = fp32_linear_ops(CPU, torch.float32)
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 1056, generator=g), torch.randn(50, generator=g)
    for op in (ops.linear_packed_q8, ops.linear_q8_gemm):
        a, c = torch.empty(rows, 50), torch.empty(rows, 50)
        op(a, x, nib.codes, nib.scales, nib.mins, b)
        op(c, x, int8.codes, int8.scales, int8.mins, b)
        assert torch.equal(a, c)
    # ...and those are the weights' products: one fp32 sum of 1056 terms from a float64 product.
    ref = x.double() @ w.double().T + b.double()
    bound = 1e-6 * 1056**0.5 * (x.abs().double() @ w.abs().double().T + 1)
    assert ((nib.linear(x, b).double() - ref).abs() <= bound).all()
