"""Tool calling and output constraints on the API side, without a model: request checks (400s naming
the field), the grammar that forces a call (checked with jsonschema against calls that must pass and
fail), the prompt for templates without tools, and Hermes parsing whole and streamed. The real-server
proof is tests/test_server_structured.py."""

import json

import jsonschema
import pytest
from tokenmill.engine.server.errors import OpenAIError
from tokenmill.engine.server.structured_request import request_structured_outputs
from tokenmill.engine.server.tools.parser import CallDelta, ToolCallStreamer, accumulate, parse_tool_calls
from tokenmill.engine.server.tools.request import (
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
    content, calls = parse_tool_calls(text, "auto")
    assert content == "Let me check." and calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    assert parse_tool_calls(two, "auto") == (
        None,
        [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": "{}"}],
    )
    assert parse_tool_calls(two, "auto", parallel=False)[1] == [{"name": "a", "arguments": "{}"}]
    # An unclosed block at EOS counts when its JSON is whole; broken JSON stays text; so does a cut block.
    assert (
        parse_tool_calls('<tool_call>{"name": "a", "arguments": {"x": 1}}', "auto")[1][0]["arguments"]
        == '{"x": 1}'
    )
    for broken in ("<tool_call>{not json</tool_call>", 'x <tool_call>{"name": "a", "arguments": {"x'):
        assert parse_tool_calls(broken, "auto") == (broken, [])
    assert parse_tool_calls("Paris. ", "auto") == ("Paris. ", [])
    # The model's own spacing is kept: arguments are the text it wrote, not re-serialized.
    spaced = '<tool_call>{"name":"a","parameters":{ "k" :[1, 2] }}</tool_call>'
    assert parse_tool_calls(spaced, "auto")[1] == [{"name": "a", "arguments": '{ "k" :[1, 2] }'}]
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>', "auto")[1] == [
        {"name": "a", "arguments": "{}"}
    ]
    assert parse_tool_calls('[{"name": "a", "arguments": {"k": 2}}]', "required") == (
        None, [{"name": "a", "arguments": '{"k": 2}'}]
    )  # fmt: skip
    assert parse_tool_calls(' {"city": "Paris"} ', "named", "get_weather") == (
        None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    )  # fmt: skip
    cut = '[{"name": "a", "argu'
    assert parse_tool_calls(cut, "required") == (cut, [])  # cut by max_tokens: the text stays the content


def _streamed(text: str, step: int, *args) -> tuple[str, list[CallDelta]]:
    streamer, content, deltas = ToolCallStreamer(*args), "", []
    for at in range(0, len(text), step):
        c, d = streamer.feed(text[at : at + step], at + step >= len(text))
        content += c
        deltas += d
    return content, deltas


AUTO_TEXT = (
    'Sure <tool_c is not a tag. <tool_call>{"name": "a", "arguments": {"q": "x<y}", "n": [1, {"m": 2}]}}</tool_call>'
    '\n<tool_call>{"name": "b", "arguments": {}}</tool_call> done'
)
REQUIRED_TEXT = '[{"name": "a", "arguments": {"q": "]}\\"", "n": [1]}}, {"name": "b", "arguments": {}}]'
NAMED_TEXT = '{"zone": "Europe/Paris", "at": {"h": [12, 30]}}'


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    "text,args",
    [(AUTO_TEXT, ("auto",)), (REQUIRED_TEXT, ("required",)), (NAMED_TEXT, ("named", "get_time"))],
    ids=["auto", "required", "named"],
)
def test_streamed_calls_add_up_to_the_whole_parse_for_any_split(step, text, args):
    content, deltas = _streamed(text, step, *args)
    whole_content, whole_calls = parse_tool_calls(text, *args)
    assert accumulate(deltas) == whole_calls and len(whole_calls) == (1 if args[0] == "named" else 2)
    for call in whole_calls:
        json.loads(call["arguments"])
    assert (content or None) == whole_content
    # OpenAI's shape: each call opens with its name and empty arguments, then fragments only.
    opened = [d.index for d in deltas if d.name is not None]
    assert opened == list(range(len(whole_calls)))
    assert all(d.arguments == "" for d in deltas if d.name is not None)
    if step == 1:  # token by token the arguments arrive in many pieces, not in one at the end
        assert sum(1 for d in deltas if d.name is None and d.index == 0) > 5
    if args[0] == "auto":
        assert content == "Sure <tool_c is not a tag. \n done"  # no tag text, the text around the blocks kept


def test_stream_holds_back_content_from_the_first_block_on():
    streamer = ToolCallStreamer("auto")
    assert streamer.feed("Let me check. ", False) == ("Let me check.", [])
    assert streamer.feed("<tool", False) == ("", [])
    content, deltas = streamer.feed('_call>{"name": "f", "arguments": {"a": 1', False)
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"a": 1')]
    content, deltas = streamer.feed("}}</tool_call>\n", False)
    assert content == "" and [d.arguments for d in deltas] == ["}"]
    assert streamer.feed("", True) == ("", [])
    # parallel_tool_calls false: a second block is dropped, whole and streamed
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    for step in (1, 1000):
        assert accumulate(_streamed(text, step, "auto", None, False)[1]) == [{"name": "f", "arguments": "{}"}]


# What the bundled SmolLM2-135M wrote, greedy, for test_server_structured.py's few-shot history
# (tool_choice none returns the raw text), 2026-12-01.
REAL_OUTPUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_real_model_output_parses_whole_and_streamed(step):
    expected = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert parse_tool_calls(REAL_OUTPUT, "auto") == (None, expected)
    content, deltas = _streamed(REAL_OUTPUT, step, "auto")
    assert content == "" and accumulate(deltas) == expected


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
    assert parse_tool_calls(out[2]["content"], "auto")[1] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
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

    from tokenmill.engine.model.tokenizer import load_tokenizer
    from tokenmill.engine.server.structured_request import check_compiles

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
