"""Structured outputs and forced tool calls through a real `tokenmill serve` (bundled model, fp32) with
the official openai client: parse() with pydantic models (nested objects, arrays, enums, patterns),
plain and streamed; tool_choice "required" and a named function return calls whose arguments validate
against the function's schema (checked here with jsonschema, not by the server); the vLLM extras and
an invalid schema's 400. Needs the grammar engine (engine/structured_output.py): skipped without it."""

import json
from enum import StrEnum
from typing import Annotated

import jsonschema
import openai
import pytest
from conftest_server import serving, wait_idle
from pydantic import BaseModel, Field

pytest.importorskip("tokenmill.engine.structured_output")

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


def test_tool_choice_required_returns_valid_calls_plain_and_streamed(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CITY, CLOCK], tool_choice="required", temperature=0, max_tokens=120
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, CLOCK)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CITY, CLOCK], tool_choice="required", temperature=0, max_tokens=120,
        stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])


def test_named_function_is_forced_and_a_tool_result_turn_follows(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CITY, CLOCK], tool_choice=named, temperature=0, max_tokens=200
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "14:05"}'},
    ]
    r2 = client.chat.completions.create(
        model=MODEL, messages=follow, tools=[CITY, CLOCK], tool_choice="none", temperature=0, max_tokens=30
    )
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


def test_vllm_extras_on_chat_and_completions(server, client):
    r = client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].text in ("yes", "no")
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
