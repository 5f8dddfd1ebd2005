"""Structured outputs and forced tool calls through a real `tokenmill serve` (bundled model, fp32) with
the official openai client: parse() with pydantic models (nested objects, arrays, enums, patterns),
plain and streamed; tool_choice "required" and a named function return calls whose arguments validate
against the function's schema (checked here with jsonschema, not by the server); the vLLM extras and
an invalid schema's 400. Needs the grammar engine (engine/structured_output/grammar.py): skipped without it."""

import json
from enum import StrEnum
from typing import Annotated

import jsonschema
import openai
import pytest
from conftest_server import serving, wait_idle
from pydantic import BaseModel, Field

pytest.importorskip("tokenmill.engine.structured_output.grammar")

MODEL = "smollm2-135m-instruct"
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, CLOCK)}


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int
    favourite: Color
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    address: Address


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving("--max-model-len", "1024", "--num-kv-blocks", "256", "--dtype", "float32",
                       log_dir=tmp_path_factory.mktemp("serve"))  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_parse_pydantic_model_plain_and_streamed(client):
    messages = [{"role": "user", "content": "Describe a person living in Paris as JSON."}]
    r = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=Person, temperature=0, max_tokens=200
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    Person.model_validate_json(r.choices[0].message.content)  # the text itself, not only the parse
    with client.chat.completions.stream(
        model=MODEL, messages=messages, response_format=Person, temperature=0, max_tokens=200
    ) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.parsed == person  # greedy: the same object both ways


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _stream(client: openai.OpenAI, **kw):
    """The openai client's stream helper (it adds the deltas up), and the raw chunks it saw."""
    chunks = []
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        return stream.get_final_completion(), chunks


def _assert_openai_call_deltas(chunks, num_calls: int) -> None:
    """Each call opens with index, id, type, name and arguments "", then arguments fragments only,
    several of them (sent as the model writes, not in one piece at the end)."""
    pieces: dict[tuple[int, int], list] = {}
    for chunk in chunks:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                pieces.setdefault((c.index, d.index), []).append(d)
    assert len(pieces) == num_calls
    for first, *rest in pieces.values():
        assert first.id.startswith("call_") and first.type == "function" and first.function.name
        assert first.function.arguments == ""
        assert len(rest) > 1 and all(d.id is None and d.function.name is None for d in rest)


def test_tool_choice_required_returns_valid_calls_plain_and_streamed(client):
    kw = dict(model=MODEL, messages=ASK, tools=[CITY, CLOCK], tool_choice="required", temperature=0,
              max_tokens=120, parallel_tool_calls=False)  # fmt: skip
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    final, chunks = _stream(client, **kw)
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content is None
    assert _calls(final.choices[0].message) == _calls(choice.message)  # greedy: the same call both ways
    _assert_openai_call_deltas(chunks, 1)


def test_required_with_n_2_gives_each_choice_valid_calls(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CITY, CLOCK], tool_choice="required", temperature=0.8, seed=3,
        max_tokens=120, n=2,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_is_forced_and_a_tool_result_turn_follows(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(
        model=MODEL, messages=ASK, tools=[CITY, CLOCK], tool_choice=named, temperature=0, max_tokens=200
    )
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])
    final, chunks = _stream(client, **kw)
    assert _calls(final.choices[0].message) == _calls(r.choices[0].message)
    assert final.choices[0].finish_reason == r.choices[0].finish_reason == "stop"  # OpenAI: named -> stop
    _assert_openai_call_deltas(chunks, 1)
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "14:05"}'},
    ]
    r2 = client.chat.completions.create(
        model=MODEL, messages=follow, tools=[CITY, CLOCK], tool_choice="none", temperature=0, max_tokens=30
    )
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


def _weather_call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}  # fmt: skip


# Two earlier turns where the assistant answered a weather question with a call: found by trying, the
# 135M model then calls on its own (greedy). Alone, "What is the weather in Paris?" got prose at
# temperature 0 and at four seeds of 0.7.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in London?"}, _weather_call("London", 1),
    {"role": "user", "content": "What is the weather in Rome?"}, _weather_call("Rome", 2),
    {"role": "user", "content": "What is the weather in Paris?"},
]  # fmt: skip


def test_tool_choice_auto_calls_on_its_own_plain_and_streamed(client):
    kw = dict(model=MODEL, messages=FEW_SHOT, tools=[CITY, CLOCK], temperature=0, max_tokens=60)
    plain = client.chat.completions.create(**kw).choices[0]
    final, chunks = _stream(client, **kw)
    streamed = final.choices[0]
    assert _calls(streamed.message) == _calls(plain.message)
    assert streamed.message.content == plain.message.content
    assert streamed.finish_reason == plain.finish_reason
    # Well-formed either way: a call names a listed tool with a JSON object, no tag text in the content;
    # and finish_reason says whether there was one.
    for name, arguments in _calls(plain.message):
        assert name in SCHEMAS and isinstance(json.loads(arguments), dict)
    assert "<tool_call>" not in (plain.message.content or "") or not plain.message.tool_calls
    assert (plain.finish_reason == "tool_calls") == bool(plain.message.tool_calls)
    # With this history it does call (seen on every run): the case the parser exists for.
    assert _calls(plain.message) and _calls(plain.message)[0][0] == "get_weather"
    _assert_openai_call_deltas(chunks, len(plain.message.tool_calls))
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert _calls(one.message) == _calls(plain.message)[:1]


def test_vllm_extras_on_chat_and_completions(server, client):
    r = client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].text in ("yes", "no")
    streamed = client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=10, temperature=0, stream=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert len(r.choices[0].message.content) == 3 and r.choices[0].message.content.isdigit()
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    # The 135M model nests objects until the limit here; what it wrote is still the start of an object.
    content = r.choices[0].message.content
    assert content.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    wait_idle(server)


def test_a_constraint_with_n_2_and_logprobs(client):
    choices = ["Paris", "Lyon", "Marseille"]
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=10, temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.message.content in choices and choice.finish_reason == "stop"
        tokens = choice.logprobs.content  # the last is the end-of-turn token the grammar allowed there
        assert (
            "".join(t.token for t in tokens[:-1]) == choice.message.content
            and tokens[-1].token == "<|im_end|>"
        )
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)


def test_invalid_schema_is_a_400_naming_the_construct(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad, max_tokens=5)
    err = e.value.body
    assert err["param"] == "response_format" and "strin" in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "("}}
        )
    assert e.value.body["param"] == "structured_outputs"
