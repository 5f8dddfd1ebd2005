"""End-to-end engine behaviour through the offline LLM API, on the real bundled model and tiny random
models, compared token-for-token with Hugging Face transformers in fp32 on CPU."""

import pathlib

import pytest
import torch
from tokenmill.engine import LLM, SamplingParams

from tests.tiny_models import make_tiny_model

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colors of the rainbow: red, orange,",
    # Longer than two blocks, so prefix caching and chunking have full blocks to work with.
    "In a quiet village at the edge of a great forest, there lived an old clockmaker who repaired "
    "every clock in the valley. One winter morning, a stranger arrived carrying a broken pocket watch",
]
MAX_TOKENS = 24


def hf_greedy(model_dir: pathlib.Path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                min_new_tokens=max_tokens, pad_token_id=0,
            )
        outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def bundled_dir(bundled_model_dir) -> pathlib.Path:
    """The reference transformers loads: the bundled GGUF dequantized to fp32 (the engine's LLM() serves
    the GGUF's blocks: the parity rule)."""
    return bundled_model_dir


@pytest.fixture(scope="module")
def llm_fp32() -> LLM:
    return LLM(dtype="float32", max_model_len=512, num_kv_blocks=128)


@pytest.fixture(scope="module")
def prompt_ids(llm_fp32: LLM) -> list[list[int]]:
    return [llm_fp32.engine.tokenize(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_tokens(bundled_dir: pathlib.Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    return hf_greedy(bundled_dir, prompt_ids, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_tokens(llm: LLM, prompt_ids: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False)
    assert llm.stats()["kv_blocks_in_use"] == 0
    return [o.outputs[0].token_ids for o in outs]


def test_bundled_model_matches_transformers_in_one_batch(llm_fp32, prompt_ids, hf_tokens) -> None:
    assert run_tokens(llm_fp32, prompt_ids) == hf_tokens


def test_same_tokens_with_prefix_caching_on_and_off_and_chunked(prompt_ids, hf_tokens) -> None:
    # A budget of 7 tokens chunks every prompt and mixes prefill chunks with decodes in one step.
    for caching in (True, False):
        llm = LLM(
            dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=7,
            enable_prefix_caching=caching,
        )
        assert run_tokens(llm, prompt_ids) == hf_tokens
        # A second pass over the same prompts hits the prefix cache (only when it is on) and still
        # produces the same tokens.
        llm.reset_stats()
        assert run_tokens(llm, prompt_ids) == hf_tokens
        hits = llm.stats()["prefix_cache_hit_tokens"]
        assert (hits > 0) if caching else (hits == 0)


def test_same_tokens_when_a_tiny_pool_forces_preemption(prompt_ids, hf_tokens) -> None:
    # 8 blocks x 16 = 128 tokens: the five sequences (about 300 tokens in all) cannot all fit.
    llm = LLM(dtype="float32", max_model_len=128, num_kv_blocks=8)
    assert run_tokens(llm, prompt_ids) == hf_tokens
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "qwen3"])
def test_tiny_random_models_match_transformers(tmp_path, bundled_dir, arch) -> None:
    model_dir = make_tiny_model(tmp_path, arch, tokenizer_dir=bundled_dir)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=11)
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    assert run_tokens(llm, ids) == hf_greedy(model_dir, ids, MAX_TOKENS)


def test_n_greater_than_one_shares_prompt_blocks_and_greedy_choices_agree(llm_fp32, prompt_ids, hf_tokens) -> None:
    outs = llm_fp32.generate(
        prompt_token_ids=[prompt_ids[4]],
        sampling_params=SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(c.token_ids == hf_tokens[4] for c in outs[0].outputs)
    assert llm_fp32.stats()["kv_blocks_in_use"] == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_fp32, prompt_ids) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = run_tokens(llm_fp32, [prompt_ids[0]], p)[0]
    in_batch = run_tokens(llm_fp32, prompt_ids, p)[0]
    other_seed = run_tokens(llm_fp32, [prompt_ids[0]], SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True))[0]
    assert alone == in_batch
    assert alone != other_seed
    # n > 1 with a seed: reproducible, and the choices differ from each other.
    pn = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = [c.token_ids for c in llm_fp32.generate(prompt_token_ids=[prompt_ids[1]], sampling_params=pn,
                                                use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in llm_fp32.generate(prompt_token_ids=[prompt_ids[1]], sampling_params=pn,
                                                use_tqdm=False)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) > 1


def test_stop_string_spanning_tokens_is_trimmed(llm_fp32, hf_tokens) -> None:
    tok = llm_fp32.get_tokenizer()
    full = tok.decode(hf_tokens[0])  # ", the city of Nova Haven was ..."
    stop = "Nova Ha"  # crosses a token boundary inside "Nova Haven"
    assert stop in full
    out = llm_fp32.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    kept = llm_fp32.generate(
        PROMPTS[0],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert llm_fp32.stats()["kv_blocks_in_use"] == 0


def test_stop_token_ids_min_tokens_and_max_tokens(llm_fp32, prompt_ids, hf_tokens) -> None:
    target = hf_tokens[0][5]
    out = llm_fp32.generate(prompt_token_ids=[prompt_ids[0]], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_tokens[0][:6] and out.finish_reason == "stop" and out.stop_reason == target
    short = llm_fp32.generate(prompt_token_ids=[prompt_ids[0]], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    # The chat answer normally ends with EOS after a few tokens; min_tokens forbids that early EOS.
    eos = llm_fp32.engine.core.eos_token_ids
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    natural = llm_fp32.chat(chat, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in eos
    forced = llm_fp32.chat(chat, SamplingParams(temperature=0.0, max_tokens=40,
                                                min_tokens=len(natural.token_ids) + 3), use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) >= len(natural.token_ids) + 3
    assert not any(t in eos for t in forced.token_ids[: len(natural.token_ids) + 2])


def test_logprobs_are_the_models_log_softmax(llm_fp32, prompt_ids, bundled_dir) -> None:
    from transformers import AutoModelForCausalLM

    out = llm_fp32.generate(prompt_token_ids=[prompt_ids[1]], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=3), use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids[1]])).logits[0, -1], dim=-1)
    top = ref.topk(3)
    entry = out.logprobs[0]
    assert next(iter(entry)) == out.token_ids[0] == int(top.indices[0])
    for tid, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert abs(entry[tid] - lp) < 1e-3


def test_priority_runs_urgent_requests_first(llm_fp32, prompt_ids) -> None:
    llm = LLM(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    order = []
    for i, prio in enumerate([5, 0, 3]):
        engine.add_request(None, prompt_ids[i], p, request_id=f"r{i}", priority=prio)
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["r1", "r2", "r0"]


def test_bad_input_raises_clear_errors_and_leaks_nothing(llm_fp32) -> None:
    with pytest.raises(ValueError, match=r"600 tokens, longer than max_model_len=512"):
        llm_fp32.generate(prompt_token_ids=[[1] * 10, [1] * 600], use_tqdm=False)
    assert llm_fp32.stats()["kv_blocks_in_use"] == 0
    assert not llm_fp32.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must be at most max_tokens \(2\)"):
        SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError, match=r"must be in \[0, 49152\)"):
        llm_fp32.generate(prompt_token_ids=[[1, 2, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm_fp32.generate(prompt_token_ids=[[]], use_tqdm=False)


def test_pool_too_small_for_one_sequence_names_the_numbers(monkeypatch) -> None:
    import tokenmill.engine.worker.worker as core  # where weights are loaded

    def must_not_load(*a, **k):
        raise AssertionError("weights were loaded before the pool size was checked")

    monkeypatch.setattr(core, "load_model", must_not_load)
    with pytest.raises(ValueError) as e:
        LLM(dtype="float32", max_model_len=512, num_kv_blocks=10)
    msg = str(e.value)
    assert "10 blocks x 16 tokens = 160 tokens" in msg and "needs 32 blocks" in msg
    assert "--num-kv-blocks" in msg and "--max-model-len" in msg


def test_out_of_range_top_k_and_seed(llm_fp32, prompt_ids) -> None:
    # top_k beyond the vocabulary means "no top-k", not an overflow inside the step.
    huge = SamplingParams(temperature=1.0, top_k=2**62, seed=3, max_tokens=4, ignore_eos=True)
    none = SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=4, ignore_eos=True)
    assert run_tokens(llm_fp32, [prompt_ids[0]], huge) == run_tokens(llm_fp32, [prompt_ids[0]], none)
    with pytest.raises(ValueError, match="seed must fit in a signed 64-bit integer"):
        SamplingParams(seed=2**64)


def test_missing_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="nope"):
        LLM(model=str(tmp_path / "nope"), dtype="float32")
