"""A PEFT adapter on the bundled SmolLM2-135M: its greedy fp32 tokens equal transformers + PEFT; in bf16
the fused C++ layer loop (llama_cpu_decoder) still runs base-only steps and never a step with adapter rows."""

import pathlib

import pytest
from lora_adapters import make_peft_adapter, peft_greedy
from tokenmill.engine import LLM, LoRARequest, SamplingParams
from tokenmill.engine.models import llama_cpu_decoder

MAX_TOKENS = 12
PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def adapter(bundled_model_dir, tmp_path_factory) -> pathlib.Path:
    return make_peft_adapter(bundled_model_dir, tmp_path_factory.mktemp("smollm-lora") / "a", r=8, alpha=16,
                             seed=5, std=0.05)  # fmt: skip


def test_bundled_model_adapter_rows_equal_peft(bundled_model_dir, adapter):
    llm = LLM(dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("a", 1, str(adapter))
    outs = llm.generate(prompt_token_ids=ids + ids, sampling_params=params, lora_request=[None, None, lora, lora],
                        use_tqdm=False)  # fmt: skip
    got = [o.outputs[0].token_ids for o in outs]
    base, tuned = peft_greedy(bundled_model_dir, None, ids, MAX_TOKENS), peft_greedy(bundled_model_dir, adapter, ids, MAX_TOKENS)
    assert all(t != b for t, b in zip(tuned, base, strict=True))  # the adapter changes the answer
    assert got == base + tuned


def test_fused_layer_loop_never_runs_a_step_with_adapter_rows(adapter, monkeypatch):
    calls: list[int] = []  # one entry per step that ran the C++ loop
    real = llama_cpu_decoder.run_layers

    def counting(layer, *args, **kwargs):
        calls.append(1)
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(llama_cpu_decoder, "run_layers", counting)
    llm = LLM(dtype="bfloat16", device="cpu", max_model_len=128, num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    ids = llm.engine.tokenize(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
    base_calls = len(calls)
    tuned = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False,
                         lora_request=LoRARequest("a", 1, str(adapter)))[0].outputs[0].token_ids  # fmt: skip
    assert len(calls) == base_calls  # no step with adapter rows went through the C++ loop
    assert tuned != base
    # Where this CPU runs the loop at all (kernels/cpu_probe.py's tier: bf16 dot kernels), the base steps used it.
    if llama_cpu_decoder.fused_layers_enabled():
        assert base_calls > 0
