"""bf16 CPU models whose weights are integer blocks (a GGUF conversion) run single rows from the codes.

On CPUs with oneDNN's bf16 and the fp32 linear kernel (AVX-512 BF16 machines), EngineCore loads such a
model in fp32, ModelRunner keeps each projection's int8 codes (1.25 bytes per weight instead of bf16's
2), casts the model to bf16 and drops the unpacked bf16 copies: rows up to bf16_codes_max_rows() run
from the codes (the bf16 dot kernel where the CPU has AVX-512 BF16, else the fp32 kernel), larger
batches on oneDNN's prepacked bf16 weights, or where the codes run every batch (the GEMM on them, or the
dense bf16 kernel on the codes rebuilt to the bf16 weights) on the codes alone.
"""

import pytest
import torch
import torch.nn.functional as F
from tokenmill.engine.layers.cpu_gemm_policy import (
    amx_codes_supported,
    amx_dequant_min_rows,
    bf16_codes_dense_min_rows,
    bf16_codes_max_rows,
    bf16_codes_wanted,
    bf16_gemm_min_rows,
    can_prepack,
)
from tokenmill.engine.layers.linear import Linear
from tokenmill.engine.model.gguf_weights import codes_supported
from tokenmill.kernels.cpu_probe import needs

CPU = torch.device("cpu")
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:", "Water boils at"]


def _q4_1_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """An fp32 weight that is exactly scale * code + min per block of 32 (codes 0..15, fp16 scales), as a
    GGUF Q4_1 conversion gives."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15  # every block spans 0..15, as llama.cpp's quantizer writes them
    lo = -(torch.rand(n, k // 32, 1, generator=g) * 0.1)
    scale = ((torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001).half()).float()
    return torch.addcmul(lo, codes.float(), scale).reshape(n, k)


def test_single_rows_run_from_the_codes_and_round_once_to_bf16() -> None:
    if not bf16_codes_wanted(CPU, torch.bfloat16):
        pytest.skip(needs("avx512"))
    w = _q4_1_weight(200, 576, seed=1)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(5))
    lin = Linear(576, 200, bias=True)  # Qwen2's qkv_proj has one: the kernel adds it in fp32
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(bias)
    lin.attach_codes()
    assert lin.packed_cpu is not None and lin.packed_cpu.codes is not None
    lin.to(torch.bfloat16)
    lin.prepack()
    assert lin.weight is None  # single rows read the codes, larger batches the packed copy
    assert (lin.packed is None) == (bf16_codes_max_rows() >= 1 << 62)  # no oneDNN copy where codes take all
    g = torch.Generator().manual_seed(2)
    max_rows = bf16_codes_max_rows()
    # Where the CPU has AMX, batches from amx_dequant_min_rows() multiply by the bf16 weights (rebuilt
    # from the codes), as oneDNN does past max_rows.
    bf16_weights_from = min(amx_dequant_min_rows() if amx_codes_supported() else max_rows + 1, max_rows + 1)
    if max_rows >= 1 << 62 and bf16_codes_dense_min_rows() < 1 << 62:
        # every batch on the codes; from bf16_codes_dense_min_rows the dense kernel on the bf16 weights
        bf16_weights_from = bf16_codes_dense_min_rows()
        max_rows = bf16_weights_from + 8
    elif max_rows >= 1 << 62:  # every batch on the codes (from bf16_gemm_min_rows the GEMM): fp32 weights
        max_rows = bf16_gemm_min_rows() + 8
        bf16_weights_from = max_rows + 3
    for rows in (*range(1, 10), bf16_weights_from - 1, bf16_weights_from, max_rows - 1, max_rows, max_rows + 1,
                 max_rows + 2):  # fmt: skip
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        out = lin(x)
        exact = F.linear(x.double(), w.double(), bias.double())  # the fp32 weights, not their bf16 rounding
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
        err = (out.double() - exact).abs()
        half_ulp = exact.abs() * 2.0**-8
        if rows < bf16_weights_from:
            # fp32 sums rounded once to bf16: within half an ulp of the exact product, plus the fp32
            # sums' own error.
            assert (err <= half_ulp + 2e-5 * (x.double().abs() @ w.double().abs().T + 1)).all()
        else:
            # The bf16 weights (oneDNN's, or the AMX GEMM's): their rounding shows (a bound ten times
            # looser, still a real one).
            assert (err <= 10 * half_ulp + 0.05).all()


TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. Heat from the sun "
    "evaporates water from seas and lakes; the vapour rises, cools and condenses into clouds. When the "
    "droplets grow heavy they fall as rain or snow, which feeds rivers and soaks into the ground, and the "
    "rivers carry the water back to the sea, where the cycle begins again."
)


def _next_tokens(llm, prompts: list[list[int]]) -> list[dict[int, float]]:
    from tokenmill.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [dict(o.outputs[0].logprobs[0]) for o in outs]  # token id -> logprob


def test_bf16_engine_keeps_codes_and_agrees_with_the_fp32_engine() -> None:
    from tokenmill.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8)
    fp32 = LLM(dtype="float32", max_model_len=256, num_kv_blocks=48)
    want = [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, params, use_tqdm=False)]
    ids = fp32.get_tokenizer().encode(TEXT)
    prefixes = [ids[:n] for n in range(4, len(ids))]
    want_next = _next_tokens(fp32, prefixes)
    del fp32
    llm = LLM(dtype="bfloat16", max_model_len=256, num_kv_blocks=48)
    model = llm.engine.core.executor.worker.runner.model
    assert next(model.parameters()).dtype == torch.bfloat16
    linears = [m for m in model.model.modules() if isinstance(m, Linear)]
    if codes_supported(CPU, torch.bfloat16, 1):
        # The bundled model's 120 projections are Q4_1 and its tied embedding Q8_0: the GGUF loader keeps
        # all of them as codes; prompts look embedding rows up in the codes (no bf16 matrix is held).
        assert len(linears) == 120 and all(m.packed_cpu is not None and m.weight is None for m in linears)
        embed = model.model.embed_tokens
        assert model.lm_head_packed_cpu is not None and embed.packed_cpu is not None and embed.weight is None
    elif can_prepack(CPU, torch.bfloat16):
        # Below AVX-512 BF16 the blocks are dequantized at load: oneDNN's bf16 weights serve every batch.
        assert all(m.packed_cpu is None and m.weight is not None for m in linears)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # Greedy bf16 drifts from fp32 once two candidates are near-tied (measured on these prompts, 64
    # tokens: the first divergence at token 10-64 on the codes, 30-61 on oneDNN's bf16 weights), so the
    # free-running check is short and the teacher-forced one below carries the weight.
    assert got == want
    # Teacher-forced, every prefix of a fixed text: the next greedy token agrees with fp32's at >= 95% of
    # positions and the top-5 logprobs are close (measured on this text: 73 of 74 and a mean 0.042 on the
    # codes, 73 of 74 and 0.052 on oneDNN's bf16 weights; over 592 positions of README.md: 98.3% and
    # 0.039, 96.5% and 0.051).
    got_next = _next_tokens(llm, prefixes)
    top1 = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(want_next, got_next, strict=True))
    diffs = [abs(a[t] - b[t]) for a, b in zip(want_next, got_next, strict=True) for t in a.keys() & b.keys()]
    assert top1 >= 0.95 * len(prefixes), f"top-1 agreed at {top1} of {len(prefixes)} positions"
    assert sum(diffs) / len(diffs) < 0.06, f"mean |logprob difference| {sum(diffs) / len(diffs):.3f}"


def test_the_codes_kernel_takes_bf16_rows_and_rounds_the_fp32_sums_once() -> None:
    from tokenmill.engine.layers.cpu_gemm_policy import fp32_linear_ops
    from tokenmill.engine.layers.linear import codes_weight

    if fp32_linear_ops(CPU, torch.float32) is None:
        pytest.skip(needs("avx2"))
    packed = codes_weight(_q4_1_weight(50, 96, seed=3))  # a ragged last panel
    bias = torch.randn(50)
    x = torch.randn(2, 96).to(torch.bfloat16)
    ops = fp32_linear_ops(CPU, torch.float32)
    for b in (None, bias):
        wide = packed.linear(x.float(), b)
        got = torch.empty(2, 50, dtype=torch.bfloat16)  # the op itself: packed.linear takes the dot kernel
        ops.linear_packed_q8(got, x, packed.codes, packed.scales, packed.mins, b)  # where the CPU has it
        assert torch.equal(got, wide.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"out must be 2-D bfloat16 \[rows of x, N\]"):
        ops.linear_packed_q8(
            torch.empty(2, 50), x, packed.codes, packed.scales, packed.mins, None
        )
