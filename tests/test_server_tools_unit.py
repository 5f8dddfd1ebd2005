"""Tool calling and output constraints on the API side, without a model: request checks (400s naming
the field), the grammar that forces a call (checked with jsonschema against calls that must pass and
fail), the prompt for templates without tools, and Hermes parsing whole and streamed. The real-server
proof is tests/test_server_structured.py."""

import json

import jsonschema
import pytest
from tokenmill.engine.entrypoints.errors import OpenAIError
from tokenmill.engine.entrypoints.structured_request import request_structured_outputs
from tokenmill.engine.entrypoints.tool_parser import StreamedToolCalls, parse_forced, parse_hermes
from tokenmill.engine.entrypoints.tool_request import (
    forcing_constraint,
    history_as_text,
    plan_tools,
    template_uses_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def _400(fn, *args, needle: str, param: str):
    with pytest.raises(OpenAIError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value.message


def test_tool_request_checks_name_the_field():
    _400(plan_tools, None, "required", None, needle="only allowed when tools", param="tool_choice")
    _400(plan_tools, [{"type": "x"}], None, None, needle="tools[0].type", param="tools")
    _400(
        plan_tools,
        [{"type": "function", "function": {"name": "a b"}}],
        None,
        None,
        needle="1-64",
        param="tools",
    )
    _400(plan_tools, [WEATHER, WEATHER], None, None, needle="given twice", param="tools")
    _400(plan_tools, [WEATHER], "sometimes", None, needle="tool_choice must be one of", param="tool_choice")
    _400(plan_tools, [WEATHER], {"type": "function", "function": {"name": "nope"}}, None,
         needle="not in tools (get_weather)", param="tool_choice")  # fmt: skip
    _400(plan_tools, [WEATHER] * 129, None, None, needle="at most 128", param="tools")
    assert plan_tools(None, "none", None) is None
    plan = plan_tools([WEATHER], None, None)
    assert plan.choice == "auto" and plan.parallel and plan.forced is None


def test_required_grammar_accepts_only_valid_calls():
    plan = plan_tools([WEATHER, TIME], "required", False)
    schema = forcing_constraint(plan).json
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    for bad in (
        [],  # at least one call
        [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "get_time", "arguments": {}},
        ],  # not parallel
        [{"name": "get_weather", "arguments": {}}],  # city is required
        [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}],
        [{"name": "launch", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    parallel = forcing_constraint(plan_tools([WEATHER, TIME], "required", True)).json
    jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, parallel)
    named = forcing_constraint(
        plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    )
    assert named.json == WEATHER["function"]["parameters"]


def test_hermes_parsing_whole_output():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check." and calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    assert [c["name"] for c in parse_hermes(two)[1]] == ["a", "b"] and parse_hermes(two)[0] is None
    # An unclosed block at EOS counts when its JSON is whole; broken JSON stays text.
    assert parse_hermes('<tool_call>{"name": "a", "arguments": {"x": 1}}')[1][0]["arguments"] == '{"x": 1}'
    broken = "<tool_call>{not json</tool_call>"
    assert parse_hermes(broken) == (broken, [])
    assert parse_hermes("Paris.") == ("Paris.", [])
    assert parse_forced('[{"name": "a", "arguments": {"k": 2}}]', "required", None) == [
        {"name": "a", "arguments": '{"k": 2}'}
    ]
    assert parse_forced('{"city": "Paris"}', "named", "get_weather")[0]["name"] == "get_weather"
    assert parse_forced('[{"name": "a", "argu', "required", None) == []  # cut by max_tokens


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_hermes_streaming_equals_whole_parse_for_any_split(step):
    text = (
        'Sure <tool_c is not a tag. <tool_call>{"name": "a", "arguments": {"q": "x<y"}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call> done'
    )
    parser, content, calls = StreamedToolCalls(), "", []
    for at in range(0, len(text), step):
        piece = text[at : at + step]
        c, done = parser.feed(piece, at + step >= len(text))
        content += c
        calls += done
    whole_content, whole_calls = parse_hermes(text)
    assert calls == whole_calls and [c["name"] for c in calls] == ["a", "b"]
    assert content.strip() == "Sure <tool_c is not a tag.  done".strip()
    assert "<tool_call>" not in content and whole_content.startswith("Sure <tool_c")


def test_history_as_text_for_templates_without_tools():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    ]  # fmt: skip
    out = history_as_text(messages, [WEATHER])
    assert (
        out[0]["role"] == "system" and "<tools>" in out[0]["content"] and "get_weather" in out[0]["content"]
    )
    assert parse_hermes(out[2]["content"])[1] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert all(set(m) == {"role", "content"} for m in out)
    with_system = history_as_text([{"role": "system", "content": "Be brief."}, *messages[:1]], [WEATHER])
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 2


def test_template_tools_detection():
    assert template_uses_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_uses_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert template_uses_tools({"default": "x", "tool_use": "y"}) and not template_uses_tools(None)


def test_response_format_and_structured_outputs_mapping():
    assert request_structured_outputs({"type": "text"}, None) is None
    assert request_structured_outputs({"type": "json_object"}, None).json_object is True
    so = request_structured_outputs(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}},
        None,
    )
    assert so.json == {"type": "object"} and so.strict is True
    assert (
        request_structured_outputs({"type": "json_schema", "json_schema": {"name": "x"}}, None).strict
        is False
    )
    assert request_structured_outputs(None, {"choice": ["yes", "no"]}).choice == ["yes", "no"]
    assert request_structured_outputs(None, {"regex": "[0-9]+"}).regex == "[0-9]+"
    with pytest.raises(OpenAIError, match="not both"):
        request_structured_outputs({"type": "json_object"}, {"regex": "a"})
    for rf, needle in [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "schema must be"),
    ]:
        _400(request_structured_outputs, rf, None, needle=needle, param="response_format")
    _400(
        request_structured_outputs,
        None,
        {"regexp": "a"},
        needle="unknown keys ['regexp']",
        param="structured_outputs",
    )
    _400(request_structured_outputs, None, {"choice": []}, needle="at least one", param="structured_outputs")
    assert json.loads(json.dumps(request_structured_outputs(None, {"grammar": 'root ::= "a"'}).grammar))


def test_an_invalid_schema_is_a_400_naming_the_request_field_and_construct(bundled_model_dir):
    import asyncio

    from tokenmill.engine.entrypoints.structured_request import check_compiles
    from tokenmill.engine.model_loader import load_tokenizer

    tokenizer = load_tokenizer(bundled_model_dir)
    bad = request_structured_outputs(
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"properties": {"a": {"type": "strin"}}}},
        },
        None,
    )
    with pytest.raises(OpenAIError) as e:
        asyncio.run(check_compiles(bad, tokenizer, "response_format"))
    assert e.value.param == "response_format" and e.value.message.startswith(
        "response_format.json_schema.schema:"
    )
    assert '"strin"' in e.value.message
    with pytest.raises(OpenAIError) as e:
        asyncio.run(
            check_compiles(request_structured_outputs(None, {"regex": "("}), tokenizer, "structured_outputs")
        )
    assert e.value.param == "structured_outputs" and "structured_outputs.regex" in e.value.message
    asyncio.run(
        check_compiles(forcing_constraint(plan_tools([WEATHER], "required", None)), tokenizer, "tool_choice")
    )
