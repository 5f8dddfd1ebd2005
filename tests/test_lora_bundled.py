"""A PEFT adapter on the bundled SmolLM2-135M: its greedy fp32 tokens equal transformers + PEFT; in bf16
the fused C++ layer loop (llama_cpu_decoder) still runs base-only steps and never a step with adapter rows."""

import pathlib

import pytest
import torch
from lora_adapters import make_peft_adapter, peft_greedy
from tokenmill.engine import LLM, LoRARequest, SamplingParams
from tokenmill.engine.models import llama_cpu_decoder

MAX_TOKENS = 12
PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def adapter(bundled_model_dir, tmp_path_factory) -> pathlib.Path:
    return make_peft_adapter(bundled_model_dir, tmp_path_factory.mktemp("smollm-lora") / "a", r=8, alpha=16,
                             seed=5, std=0.05)  # fmt: skip


@pytest.fixture(scope="module")
def fp32_llm() -> LLM:
    return LLM(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=128, enable_lora=True, max_lora_rank=8)


@pytest.fixture(scope="module")
def bf16_llm() -> LLM:
    return LLM(dtype="bfloat16", device="cpu", max_model_len=256, num_kv_blocks=128, enable_lora=True, max_lora_rank=8)


def test_bundled_model_adapter_rows_equal_peft(bundled_model_dir, adapter, fp32_llm):
    llm = fp32_llm
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("a", 1, str(adapter))
    outs = llm.generate(prompt_token_ids=ids + ids, sampling_params=params, lora_request=[None, None, lora, lora],
                        use_tqdm=False)  # fmt: skip
    got = [o.outputs[0].token_ids for o in outs]
    base, tuned = peft_greedy(bundled_model_dir, None, ids, MAX_TOKENS), peft_greedy(bundled_model_dir, adapter, ids, MAX_TOKENS)
    assert all(t != b for t, b in zip(tuned, base, strict=True))  # the adapter changes the answer
    assert got == base + tuned


def test_fused_layer_loop_never_runs_a_step_with_adapter_rows(adapter, bf16_llm, monkeypatch):
    calls: list[int] = []  # one entry per step that ran the C++ loop
    real = llama_cpu_decoder.run_layers

    def counting(layer, *args, **kwargs):
        calls.append(1)
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(llama_cpu_decoder, "run_layers", counting)
    llm = bf16_llm
    ids = llm.engine.tokenize(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
    base_calls = len(calls)
    tuned = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False,
                         lora_request=LoRARequest("a", 1, str(adapter)))[0].outputs[0].token_ids  # fmt: skip
    assert len(calls) == base_calls  # no step with adapter rows went through the C++ loop
    assert tuned != base
    # Where this CPU runs the loop at all (kernels/cpu_probe.py's tier: bf16 dot kernels), the base steps used it.
    if llama_cpu_decoder.fused_layers_enabled(torch.bfloat16):
        assert base_calls > 0


def test_bf16_adapter_rows_are_as_accurate_as_peft_in_bf16(bundled_model_dir, adapter, fp32_llm, bf16_llm):
    """The bf16 engine's adapter rows against the fp32 engine's, teacher-forced over every prefix of a text,
    measured as test_half_checkpoints measures the base model: no worse than transformers + PEFT in bf16 is
    against transformers + PEFT in fp32 (top-1 agreement, mean |logprob difference| over fp32's top 5)."""
    import torch
    from peft import PeftModel
    from test_half_checkpoints import TEXT, _hf

    lora = LoRARequest("a", 1, str(adapter))
    ids = fp32_llm.get_tokenizer().encode(TEXT)
    prefixes = [ids[:n] for n in range(4, len(ids), 2)]  # every other prefix: half the time, 38 positions

    def engine_next(llm: LLM) -> list[dict[int, float]]:
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
        outs = llm.generate(prompt_token_ids=prefixes, sampling_params=params, use_tqdm=False, lora_request=lora)
        return [dict(o.outputs[0].logprobs[0]) for o in outs]

    want, got = engine_next(fp32_llm), engine_next(bf16_llm)

    def peft_logprobs(dtype: torch.dtype) -> torch.Tensor:
        model = PeftModel.from_pretrained(_hf(bundled_model_dir, dtype), adapter).eval()
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    exact, rounded = peft_logprobs(torch.float32), peft_logprobs(torch.bfloat16)
    rows = [len(p) - 1 for p in prefixes]
    assert [max(w, key=w.get) for w in want] == exact[rows].argmax(-1).tolist()  # fp32 engine = PEFT fp32
    hf_top1 = int((rounded[rows].argmax(-1) == exact[rows].argmax(-1)).sum())
    hf_diff = [abs(float(exact[r, t] - rounded[r, t])) for r, w in zip(rows, want, strict=True) for t in w]
    our_top1 = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(want, got, strict=True))
    our_diff = [abs(a[t] - b[t]) for a, b in zip(want, got, strict=True) for t in a.keys() & b.keys()]
    hf_mean, our_mean = sum(hf_diff) / len(hf_diff), sum(our_diff) / len(our_diff)
    print(f"\nbf16 + LoRA: top-1 vs fp32 at {our_top1} of {len(prefixes)} (PEFT {hf_top1}); "
          f"mean |logprob diff| {our_mean:.4f} (PEFT {hf_mean:.4f})")
    assert our_top1 >= hf_top1 - 1, (our_top1, hf_top1)
    assert our_mean <= 1.5 * hf_mean, (our_mean, hf_mean)
