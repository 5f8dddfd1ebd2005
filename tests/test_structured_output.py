"""Structured outputs end to end in fp32 on a tiny random llama with the bundled tokenizer (fast on two
cores; the grammar, not the weights, makes the output valid): the engine's greedy output equals greedy
over a masked Hugging Face reference stepped token by token in this file, with the allowed tokens
computed here (a brute-force prefix check for `choice`, a matcher of this file's own for schemas and
regexes: not the sampler's code path). Also: preemption, prefix hits, n > 1, raw logprobs, no leaks."""

import json
import pathlib

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from tokenmill.engine import LLM, SamplingParams, StructuredOutputsParams

from tests.tiny_models import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
}
PROMPT = "Describe a person as JSON:"
REGEX = r"[0-9]{3}-[A-Z]{2}"
CHOICES = ["Paris", "London", "Berlin", "Rome"]
MAX_TOKENS = 40
# No free whitespace: a random model would otherwise spend its tokens on it.
JSON_SO = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, bundled_model_dir) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("so"), "llama", tokenizer_dir=bundled_model_dir)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def test_compiler(llm):
    """This file's own xgrammar compiler (not engine/structured_output/grammar.py's)."""
    tok = llm.get_tokenizer()
    vocab = llm.engine.core.model_config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, max_threads=1)


def hf_masked_greedy(hf, prompt_ids, allowed_fn, done_fn, max_tokens):
    """Greedy decoding with transformers, restricted each step to allowed_fn(output so far) (a bool
    numpy array over the vocab). Returns (tokens, raw log-softmax of each chosen token)."""
    out: list[int] = []
    raw_lps: list[float] = []
    past = None
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_tokens):
            r = hf(input_ids=x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            logits = r.logits[0, -1]
            allowed = torch.from_numpy(allowed_fn(out))
            assert allowed.any()
            tok = int(torch.where(allowed, logits, torch.tensor(float("-inf"))).argmax())
            raw_lps.append(float(torch.log_softmax(logits, dim=-1)[tok]))
            out.append(tok)
            if done_fn(out):
                break
            x = torch.tensor([[tok]])
    return out, raw_lps


def matcher_reference(compiled, vocab):
    """allowed/done functions driven by a matcher of the test's own, unpacking its bitmask with numpy."""
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    seen = [0]

    def advance(out):
        for t in out[seen[0] :]:
            assert m.accept_token(t)
        seen[0] = len(out)

    def allowed(out):
        advance(out)
        m.fill_next_token_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        return bits[:vocab].astype(bool)

    def done(out):
        advance(out)
        return m.is_terminated()

    return allowed, done


def choice_reference(tok, vocab, choices, eos=2):
    """Brute force: a token is allowed when the text so far plus the token is a prefix of a choice;
    EOS only once the text is exactly a choice."""
    pieces = [tok.decode([t]) for t in range(len(tok))] + [""] * (vocab - len(tok))
    special = set(tok.all_special_ids)

    def allowed(out):
        text = tok.decode(out)
        ok = np.zeros(vocab, dtype=bool)
        for t, piece in enumerate(pieces):
            if piece and t not in special and any(c.startswith(text + piece) for c in choices):
                ok[t] = True
        if text in choices:
            ok[eos] = True
        return ok

    return allowed, lambda out: out[-1] == eos


def generate(llm, prompts, so, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["kv_blocks_in_use"] == 0
    return outs


def test_json_schema_greedy_equals_masked_reference_and_validates(llm, hf, test_compiler):
    vocab = llm.engine.core.model_config.vocab_size
    out = generate(llm, [PROMPT], JSON_SO, logprobs=0)[0].outputs[0]
    compiled = test_compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    allowed, done = matcher_reference(compiled, vocab)
    ids = llm.engine.tokenize(PROMPT)
    ref, ref_lps = hf_masked_greedy(hf, ids, allowed, done, MAX_TOKENS)
    assert out.token_ids == ref
    assert out.finish_reason == "stop" and ref[-1] == 2
    jsonschema.validate(json.loads(out.text), SCHEMA)
    # Logprobs are of the model's raw distribution (vLLM's default), not of the masked one.
    got = [next(iter(d.values())) for d in out.logprobs]
    assert got == pytest.approx(ref_lps, abs=1e-3)
    assert any(lp < -1e-2 for lp in got)  # masked logprobs of a greedy pick would all be ~0 or more


def test_regex_greedy_equals_masked_reference(llm, hf, test_compiler):
    vocab = llm.engine.core.model_config.vocab_size
    prompt = "The code is"
    out = generate(llm, [prompt], StructuredOutputsParams(regex=REGEX))[0].outputs[0]
    allowed, done = matcher_reference(test_compiler.compile_regex(REGEX), vocab)
    ref, _ = hf_masked_greedy(hf, llm.engine.tokenize(prompt), allowed, done, MAX_TOKENS)
    assert out.token_ids == ref
    import re

    assert re.fullmatch(REGEX, out.text)


def test_choice_greedy_equals_brute_force_reference_for_each_of_n(llm, hf):
    vocab = llm.engine.core.model_config.vocab_size
    prompt = "The capital of Italy is"
    outs = generate(llm, [prompt], StructuredOutputsParams(choice=CHOICES), n=2)[0].outputs
    allowed, done = choice_reference(llm.get_tokenizer(), vocab, CHOICES)
    ref, _ = hf_masked_greedy(hf, llm.engine.tokenize(prompt), allowed, done, 8)
    assert [o.token_ids for o in outs] == [ref, ref]
    assert outs[0].text in CHOICES and outs[0].finish_reason == "stop"


def test_mixed_batch_preemption_and_prefix_hits_give_the_same_tokens(llm, model_dir):
    # A shared prefix of more than two blocks, so the second run has full blocks to hit.
    prefix = ("In a quiet village at the edge of a great forest, there lived an old clockmaker who repaired "
              "every clock in the valley. ")
    prompts = [prefix + p for p in (PROMPT, "The code is", "Tell me about cats.", "The capital of Italy is")]
    specs = [
        JSON_SO,
        StructuredOutputsParams(regex=REGEX),
        None,  # no grammar in the same batch: its tokens are today's
        StructuredOutputsParams(choice=CHOICES),
    ]

    def run(engine):
        params = [
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so, ignore_eos=so is None)
            for so in specs
        ]
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert engine.stats()["kv_blocks_in_use"] == 0
        return [o.outputs[0].token_ids for o in outs]

    alone = [run_one(llm, p, so) for p, so in zip(prompts, specs, strict=True)]
    assert run(llm) == alone  # batched with each other
    assert run(llm) == alone  # again: the prompts now hit the prefix cache
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    # 7 blocks x 16 tokens: the four sequences (about 4 x 70 tokens) cannot all fit, so some are preempted and recomputed.
    tiny = LLM(model=str(model_dir), dtype="float32", max_model_len=112, num_kv_blocks=7)
    assert run(tiny) == alone
    assert tiny.stats()["num_preemptions"] > 0


def run_one(llm, prompt, so):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so, ignore_eos=so is None)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_invalid_spec_raises_naming_the_construct_and_leaks_nothing(llm):
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "tuple"}}})
    with pytest.raises(ValueError, match=r'structured_outputs\.json: .*Unsupported type "tuple"'):
        llm.generate([PROMPT], SamplingParams(structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: .*Lookbehind"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(?<=a)b")))
    assert llm.stats()["kv_blocks_in_use"] == 0
    assert not llm.engine.has_unfinished_requests()
