"""Fuzzing a real `tokenmill serve` (tiny random Llama, loopback): no input may produce a 5xx.

- schemathesis generates requests from the server's own OpenAPI document (/openapi.json), every
  operation, a bounded number of examples each (FUZZ_EXAMPLES); every answer must be below 500 and every
  4xx must be OpenAI's error shape.
- hypothesis draws sampling parameters (in and far out of range) and chat messages (odd roles, empty and
  non-text content, unicode); in-range values must succeed, out-of-range ones must be a 400 naming the
  parameter, and nothing may leak a KV block.
"""

import json
import math
import os

import httpx
import hypothesis.strategies as st
import pytest
import schemathesis
from conftest_server import serving, wait_idle
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from tiny_models import make_tiny_model

MODEL = "tiny"
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 4
FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20"))
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    yield from serving(
        "--model", str(model), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", "48", "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32",
        "--disable-access-log", log_dir=tmp_path_factory.mktemp("serve"),
    )  # fmt: skip


def check_answer(r, what: str) -> None:
    assert r.status_code < 500, f"{what} -> {r.status_code}: {r.text[:500]}"
    if 400 <= r.status_code < 500:  # OpenAI's error shape, as its SDK parses it
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), r.text


def with_our_model(case_and_flip):
    """Half the generated bodies that name a model name the served one, so they get past the 404 for an
    unknown model and reach validation and the engine (the rest keep schemathesis's own value)."""
    case, flip = case_and_flip
    if flip and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def test_no_input_from_the_openapi_document_gets_a_5xx(server):
    # schemathesis's own pytest plugin (from_fixture) does not run under pytest 9, so each operation's
    # strategies (valid and invalid inputs by the document) are driven by hypothesis here.
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    document = httpx.get(f"{server.url}/openapi.json").json()
    assert {(op.method.lower(), op.path) for op in operations} == {
        (method, path) for path, ops in document["paths"].items() for method in ops
    }  # every operation the document lists
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"} <= {op.path for op in operations}
    statuses: dict[int, int] = {}
    for op in operations:
        cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))
        strategy = st.tuples(cases, st.booleans()).map(with_our_model)

        @given(case=strategy)
        @FUZZ_SETTINGS
        def fuzz(case) -> None:
            r = case.call(timeout=120)
            check_answer(r, case.as_curl_command())
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        fuzz()
    print(f"schemathesis: {len(operations)} operations, answers by status {dict(sorted(statuses.items()))}")
    assert statuses.get(200) and statuses.get(400), statuses  # it reached the engine and the validators


def test_fuzzing_leaked_nothing(server):
    wait_idle(server, timeout_s=120)


# ---- hypothesis: sampling parameters -------------------------------------------------------------------
# The documented limits (vLLM's and OpenAI's ranges), written here apart from the server's checks: the
# oracle. Each takes the value and the whole body (min_tokens is bounded by max_tokens).
VOCAB = 49152  # the bundled tokenizer's, which the tiny model uses
INT64 = 2**63
LIMITS = {
    "temperature": lambda v, b: v >= 0,
    "top_p": lambda v, b: 0 < v <= 1,
    "min_p": lambda v, b: 0 <= v <= 1,
    "presence_penalty": lambda v, b: -2 <= v <= 2,
    "frequency_penalty": lambda v, b: -2 <= v <= 2,
    "repetition_penalty": lambda v, b: v > 0,
    "top_k": lambda v, b: v >= -1,
    "max_tokens": lambda v, b: 1 <= v < MAX_MODEL_LEN - 16,  # the prompt below is well under 16 tokens
    "min_tokens": lambda v, b: 0 <= v <= b["max_tokens"],
    "n": lambda v, b: 1 <= v <= MAX_NUM_SEQS,
    "logprobs": lambda v, b: 0 <= v <= 20,
    "seed": lambda v, b: -INT64 <= v < INT64 - b.get("n", 1),
    "stop_token_ids": lambda v, b: all(0 <= t < VOCAB for t in v),
    "logit_bias": lambda v, b: all(0 <= int(k) < VOCAB and -100 <= x <= 100 for k, x in v.items()),
}
finite = st.floats(min_value=-1e300, max_value=1e300, allow_nan=False)
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3))
PARAM_VALUES = {
    "temperature": st.one_of(st.floats(0, 2), finite),
    "top_p": st.one_of(st.floats(0.01, 1), finite),
    "min_p": st.one_of(st.floats(0, 1), finite),
    "presence_penalty": st.one_of(st.floats(-2, 2), finite),
    "frequency_penalty": st.one_of(st.floats(-2, 2), finite),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), finite),
    "top_k": st.integers(-5, 100),
    # Clear of the prompt's own length, so the oracle needs no tokenizer.
    "max_tokens": st.one_of(st.integers(-3, MAX_MODEL_LEN - 17), st.integers(MAX_MODEL_LEN, MAX_MODEL_LEN + 10)),
    "min_tokens": st.integers(-2, 40),
    "n": st.integers(-1, MAX_NUM_SEQS + 2),
    "logprobs": st.integers(-2, 25),
    "seed": st.one_of(st.integers(0, 2**32), st.integers(-(2**64), 2**64)),
    "stop_token_ids": st.lists(token_id, max_size=3),
    "logit_bias": st.dictionaries(token_id.map(str), st.floats(-200, 200), max_size=3),
    "stream": st.booleans(),
}


def names_a_broken_field(err: dict, broken: list[str]) -> bool:
    return err["param"] in broken or any(k in err["message"] for k in broken)


def completion_choices(r: httpx.Response, stream: bool) -> list[dict]:
    """The choices of a completion, a stream's folded into one per index (text joined, last finish)."""
    if not stream:
        return r.json()["choices"]
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-300:]
    folded: dict[int, dict] = {}
    for e in events[:-1]:
        for c in json.loads(e)["choices"]:
            f = folded.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": None})
            f["text"] += c["text"]
            f["finish_reason"] = c["finish_reason"] or f["finish_reason"]
            f["logprobs"] = c.get("logprobs") or f["logprobs"]
    return [folded[i] for i in sorted(folded)]


@given(params=st.fixed_dictionaries({}, optional=PARAM_VALUES))
@FUZZ_SETTINGS
def test_sampling_parameters_are_enforced(server, params):
    body = {"model": MODEL, "prompt": "Hello there", **params}
    body.setdefault("max_tokens", 4)
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    check_answer(r, str(body))
    broken = sorted(k for k, v in body.items() if k in LIMITS and not LIMITS[k](v, body))
    if broken:
        assert r.status_code == 400, (body, r.text)
        assert names_a_broken_field(r.json()["error"], broken), (broken, r.text)
        return
    assert r.status_code == 200, (body, r.text)
    choices = completion_choices(r, body.get("stream", False))
    assert len(choices) == body.get("n", 1), r.text
    for c in choices:
        assert c["finish_reason"] in ("stop", "length"), c
        if "logprobs" in body:
            assert all(math.isfinite(x) for x in c["logprobs"]["token_logprobs"]), c
    if not body.get("stream"):
        assert r.json()["usage"]["completion_tokens"] <= body["max_tokens"] * body.get("n", 1)


# ---- hypothesis: chat messages -------------------------------------------------------------------------
ROLES = ["system", "user", "assistant", "tool", "developer", "bogus", ""]
text = st.text(st.characters(codec="utf-8"), max_size=40)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": text})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES), "content": st.one_of(st.none(), text, st.lists(part, max_size=3))},
    optional={"tool_call_id": st.text(max_size=8), "name": text},
)


def message_is_valid(m: dict) -> bool:
    """OpenAI's rules as this server documents them (docs/serving.md), written apart from the server."""
    if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
        return False
    if m["content"] is None and m["role"] != "assistant":
        return False
    if isinstance(m["content"], list) and any(p["type"] != "text" for p in m["content"]):
        return False
    return m["role"] != "tool" or bool(m.get("tool_call_id"))


@given(messages=st.lists(message, max_size=4))
@FUZZ_SETTINGS
def test_chat_messages_are_checked_and_never_crash_the_server(server, messages):
    valid = bool(messages) and all(message_is_valid(m) for m in messages)
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}),
        ("/tokenize", {"model": MODEL, "messages": messages}),
    ):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        check_answer(r, f"{path} {body}")
        if not valid:
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (body, r.text)
        elif path == "/tokenize":
            assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0, (body, r.text)
        elif r.status_code == 400:  # a valid chat whose prompt leaves no room for 3 tokens
            assert "max_model_len" in r.json()["error"]["message"], (body, r.text)
        else:
            assert r.status_code == 200, (body, r.text)
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def test_hypothesis_leaked_nothing(server):
    wait_idle(server, timeout_s=120)
