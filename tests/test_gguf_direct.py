"""GGUF weights loaded as the file stores them (engine/model/gguf_weights.py): the parity rule against the
same weights dequantized to fp32 (gguf_cache.dequantized_copy_cached), and nothing dequantized in memory.

- fp32: the codes kernels rebuild every weight exactly and sum in the fp32 kernels' order, so logits equal
  the fp32 copy's bit for bit (steps of up to 16 rows, where the copy's fp32 panels run the same sums),
  and greedy tokens equal transformers' on the copy.
- bf16: activations are rounded to bf16 (as any bf16 model's are); the weights are not. Stated
  tolerance: against the fp32 reference, teacher-forced top-1 agreement no lower than transformers' bf16
  on the same copy, and a mean |log-probability| error within 1.5x of its.
"""

import pathlib

import pytest
import torch
from tokenmill.engine.layers.grouped_codes import GroupedPackedWeight, SplitPackedWeight
from tokenmill.engine.layers.linear import CpuPackedWeight
from tokenmill.engine.model.gguf_cache import dequantized_copy_cached
from tokenmill.engine.model.loader import load_model
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.model_config import load_model_config
from tokenmill.kernels import cpu as cpu_kernels

from tests.test_model_gguf import TINY_VOCAB, write_gguf
from tests.test_model_llama import _forward_all, _hf_logits, _hf_model
from tests.tiny_models import make_kv_caches, make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C++ CPU kernels")

BLOCK = 16


def _layer_types(layer: int, q: str, k: str, v: str, o: str, gate: str, up: str, down: str) -> dict[str, str]:
    p = f"model.layers.{layer}."
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")  # fmt: skip
    return {f"{p}{n}.weight": t for n, t in zip(names, (q, k, v, o, gate, up, down), strict=True)}


# Every type the loader keeps as codes, in one model: layer 0 as llama.cpp's Q4_K_M lays a layer out
# (q, k Q4_K; v, down Q6_K: qkv_proj mixes layouts), layer 1 the 32-weight types.
TYPES = {
    "model.embed_tokens.weight": "Q4_K",
    "lm_head.weight": "Q6_K",
    **_layer_types(0, "Q4_K", "Q4_K", "Q6_K", "Q5_K", "Q4_K", "Q4_K", "Q6_K"),
    **_layer_types(1, "Q8_0", "Q8_0", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_1"),
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(the GGUF's folder the engine loads, its fp32 dequantized copy, the GGUF) of a tiny Llama whose
    K = 256 rows hold whole K-quant super-blocks."""
    tmp = tmp_path_factory.mktemp("q")
    hf = make_tiny_model(tmp, "llama", vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512)
    gguf = write_gguf(tmp / "q.gguf", hf, "llama", types=TYPES)
    return resolve_model(gguf), dequantized_copy_cached(gguf), gguf


def _kv(config):
    return make_kv_caches(config.num_hidden_layers, 32, BLOCK, config.num_key_value_heads, config.head_dim,
                          torch.float32)  # fmt: skip


def _decode_logits(model, seq: list[int], prompt: int) -> torch.Tensor:
    """Logits of seq fed as a prompt of `prompt` tokens then one token per step: [len(seq) - prompt + 1, V]."""
    kv = _kv(model.config)
    table = [[3, 7, 1, 12, 5, 9]]
    out = [_forward_all(model, kv, [seq], table, [0], [prompt])[-1:]]
    for i in range(prompt, len(seq)):
        out.append(_forward_all(model, kv, [seq], table, [i], [1]))
    return torch.cat(out)


def test_every_quantized_weight_is_held_as_codes_and_no_float_copy(quantized) -> None:
    folder, _, _ = quantized
    model = load_model(folder, load_model_config(folder), torch.float32, "cpu")
    kinds = {}
    for name, module in model.named_modules():
        packed = getattr(module, "packed_cpu", None)
        if packed is not None:
            assert getattr(module, "weight", None) is None, name  # the codes stand for it
            kinds[name] = type(packed)
    assert kinds["model.layers.0.self_attn.qkv_proj"] is SplitPackedWeight  # Q4_K q, k + Q6_K v
    assert kinds["model.layers.0.mlp.gate_up_proj"] is GroupedPackedWeight
    assert kinds["model.layers.1.self_attn.qkv_proj"] is CpuPackedWeight  # Q8_0: the codes layout
    assert kinds["model.layers.1.mlp.gate_up_proj"] is SplitPackedWeight  # Q5_0 + Q5_1
    assert kinds["lm_head"] is GroupedPackedWeight and model.lm_head_packed_cpu is model.lm_head.packed_cpu
    floats = {n: p.shape for n, p in model.named_parameters() if p.dim() == 2 and p.numel()}
    assert floats == {}, floats


def test_fp32_logits_equal_the_dequantized_copy_bit_for_bit(quantized) -> None:
    folder, copy, _ = quantized
    ours = load_model(folder, load_model_config(folder), torch.float32, "cpu")
    ref = load_model(copy, load_model_config(copy), torch.float32, "cpu")
    ref.pack_linears_cpu(blocks=True)  # as the engine serves the copy: codes where exact, fp32 panels elsewhere
    seq = torch.randint(3, TINY_VOCAB, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b = _decode_logits(ours, seq, 12), _decode_logits(ref, seq, 12)
    assert torch.equal(a, b)
    # ... and they are the copy's logits in transformers, to its fp32 summation order (test_model_llama's bound).
    hf = _hf_logits(_hf_model(copy), seq)[11:]
    torch.testing.assert_close(a, hf, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_transformers_on_the_dequantized_copy(quantized) -> None:
    from tokenmill.engine import LLM, SamplingParams

    folder, copy, _ = quantized
    hf = _hf_model(copy)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=256)
    prompts = [[5, 17, 40, 2, 99], [250, 3, 3, 77, 120, 9, 31]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        ids = list(p)
        for _ in range(12):
            ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
        assert out.outputs[0].token_ids == ids[len(p) :]


def test_bf16_serves_the_codes_within_the_stated_tolerance(quantized) -> None:
    """bf16 rounds activations (ours) and weights too (transformers' bf16 on the copy): against the fp32
    reference, ours must agree on the next token at least as often as transformers in bf16 and keep its
    mean log-probability error within 1.5x of transformers' (test_half_checkpoints' bounds)."""
    folder, copy, _ = quantized
    ours = load_model(folder, load_model_config(folder), torch.bfloat16, "cpu")
    seq = torch.randint(3, TINY_VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    kv = make_kv_caches(2, 32, BLOCK, 2, 64, torch.bfloat16)
    got = _forward_all(ours, kv, [seq], [[3, 7, 1, 9]], [0], [len(seq)])
    ref = _hf_logits(_hf_model(copy), seq)
    theirs = _hf_logits(_hf_model(copy, torch.bfloat16), seq)
    agree = lambda x: int((x.argmax(-1) == ref.argmax(-1)).sum())  # noqa: E731
    err = lambda x: (x.log_softmax(-1) - ref.log_softmax(-1)).abs().mean().item()  # noqa: E731
    assert agree(got) >= agree(theirs), (agree(got), agree(theirs))
    assert err(got) <= 1.5 * err(theirs), (err(got), err(theirs))


def _codes(model) -> dict[str, tuple[torch.Tensor, ...]]:
    out = {name: m.packed_cpu for name, m in model.named_modules() if getattr(m, "packed_cpu", None) is not None}
    out["lm_head"] = model.lm_head_packed_cpu  # the tied embedding's codes (embed_tokens: their lookup)
    out.pop("model.embed_tokens", None)
    return {name: (p.codes, p.scales, p.mins) for name, p in out.items() if isinstance(p, CpuPackedWeight)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bundled_model_runs_the_codes_its_fp32_copy_is_searched_for(bundled_model_dir, bundled_gguf_dir, dtype) -> None:
    """The bundled Q4_1 / Q8_0 GGUF loaded from its blocks holds the very codes, scales and mins that
    searching its dequantized fp32 copy finds (layers/weight_codes.py), so every kernel computes as it
    did: logits equal bit for bit (fp32: a prefill and decode steps; bf16: decode steps, where both run the
    codes kernels; the copy's bf16 prompts beyond bf16_codes_max_rows run oneDNN on bf16-rounded weights)."""
    from tokenmill.engine.model.gguf_weights import codes_supported
    from tokenmill.engine.worker.cpu_weights import loading_hooks, plan_weights, prepare_weights

    cpu = torch.device("cpu")
    models = []
    for folder in (bundled_gguf_dir, bundled_model_dir):
        plan = plan_weights(cpu, dtype, folder, 1)
        m = load_model(folder, load_model_config(folder), plan.load_dtype, cpu,
                       fp32_hooks=lambda m, plan=plan: loading_hooks(m, cpu, dtype, plan))  # fmt: skip
        prepare_weights(m, cpu, dtype, plan, streamed=True)
        models.append(m)
    direct, copy = (_codes(m) for m in models)
    # Where no codes kernel runs this dtype (bf16 below AVX-512 BF16) neither keeps codes: both hold the
    # same dequantized weights, and the logits must still be equal.
    want = 30 * 4 + 1 if codes_supported(cpu, dtype, 1) else 0
    assert len(direct) == want and direct.keys() == copy.keys()
    for name in direct:
        for a, b in zip(direct[name], copy[name], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    seq = [1, 9690, 2683, 253, 655, 28, 2127, 314, 30, 3548, 4768, 28, 2683, 253, 655]
    prompt = 12 if dtype == torch.bfloat16 else len(seq) - 1  # fp32: a 14-row prefill then one step
    logits = []
    for m in models:
        kv = make_kv_caches(30, 8, BLOCK, 3, 64, dtype)
        steps = [_forward_all(m, kv, [seq], [[2, 5]], [0], [prompt])[-1:]]
        steps += [_forward_all(m, kv, [seq], [[2, 5]], [i], [1]) for i in range(prompt, len(seq))]
        logits.append(torch.cat(steps))
    assert torch.equal(*logits)


def test_where_no_codes_kernel_runs_the_weights_are_dequantized_at_load(quantized) -> None:
    folder, copy, _ = quantized
    ours = load_model(folder, load_model_config(folder), torch.float16, "cpu")
    twin = load_model(copy, load_model_config(copy), torch.float16, "cpu")
    mine, theirs = dict(ours.named_parameters()), dict(twin.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def _leaves(model) -> dict[str, object]:
    """Every packed weight of the model's linears, a split weight's parts named name[i]."""
    out = {}
    for name, module in model.named_modules():
        packed = getattr(module, "packed_cpu", None)
        for i, part in enumerate(packed.parts if isinstance(packed, SplitPackedWeight) else [packed]):
            if part is not None:
                out[f"{name}[{i}]"] = part
    return out


def test_int8_activations_take_exactly_the_formats_with_an_int8_kernel(quantized) -> None:
    """--int8-activations (worker.use_int8_activations) on every layout of a GGUF: the 32-weight codes and the
    4-bit grouped ones (Q4_K here) round x to int8; Q5_*, Q6_K stay exact. How close the tokens stay is
    measured on real weights (tests/test_int8_activations.py): this random model is too sensitive to say
    (transformers' own bf16 moves its logprobs by 0.11 nats on average)."""
    from tokenmill.engine.worker.cpu_weights import use_int8_activations

    folder, _, _ = quantized
    exact = load_model(folder, load_model_config(folder), torch.float32, "cpu")
    int8 = load_model(folder, load_model_config(folder), torch.float32, "cpu")
    leaves = _leaves(int8)
    assert use_int8_activations(int8) == sum(
        isinstance(p, CpuPackedWeight) or p.int8x_supported for p in leaves.values()
    )
    flagged = {name for name, p in leaves.items() if p.int8_x}
    assert "model.layers.0.mlp.gate_up_proj[0]" in flagged  # Q4_K, grouped
    assert "model.layers.0.self_attn.qkv_proj[0]" in flagged  # Q4_K q of a split q|k|v
    assert "model.layers.1.mlp.down_proj[0]" in flagged  # Q4_1, codes
    assert "lm_head[0]" not in flagged and "model.layers.0.mlp.down_proj[0]" not in flagged  # Q6_K
    assert not any(p.int8_x for p in _leaves(exact).values())
    seq = torch.randint(3, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    a = _decode_logits(exact, seq, 24)  # a 24-row prefill (past 16 rows) and 16 decode steps
    assert not torch.equal(a, _decode_logits(int8, seq, 24))  # the mode is on
