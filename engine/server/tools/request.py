"""A chat request's tools: validate `tools`, `tool_choice` and `parallel_tool_calls`, build the grammar
that forces a call (`required`, a named function), and put the tools into the prompt.

Prompt: a chat template that uses the `tools` variable (Qwen2.5, Qwen3, Hermes models) gets them
there, and renders tool calls and tool results itself. A template that ignores `tools` (the bundled
SmolLM2's plain ChatML) would silently drop them, so for it we write the tools into the system message
in the Hermes format the parser reads back (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`),
and turn history into text the same way: an assistant's calls as `<tool_call>` blocks, a tool's result
as a user turn inside `<tool_response>`.

Forcing: `required` constrains the output to a JSON array of {"name", "arguments"} objects (one item
when parallel_tool_calls is false), `named` to the function's arguments object, each argument
validating against the function's `parameters` schema. `auto` lets the model choose and the parser
reads whatever calls it wrote; `none` leaves the output as text.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.sampling_params import StructuredOutputsParams
from tokenmill.engine.server.errors import bad_request

MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}} entries
    choice: str  # none | auto | required | named
    named: str | None = None  # the function a named choice forces
    parallel: bool = True

    @property
    def forced(self) -> StructuredOutputsParams | None:
        return forcing_constraint(self)


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None
) -> ToolPlan | None:
    """None when the request has no tools (and no tool_choice other than none); else the checked plan."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools may list at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}].type must be 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"tools[{i}].function is required: an object with name and parameters", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise bad_request(
                f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -; got {name!r}",
                "tools",
            )
        if name in names:
            raise bad_request(f"tools[{i}].function.name {name!r} is given twice", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(name)
    choice, named = "auto", None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(named, str):
            raise bad_request(
                'tool_choice as an object must be {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if named not in names:
            raise bad_request(
                f"tool_choice names function {named!r}, which is not in tools ({', '.join(names)})",
                "tool_choice",
            )
        choice = "named"
    elif tool_choice is not None:
        if tool_choice not in TOOL_CHOICES:
            raise bad_request(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function; got {tool_choice!r}",
                "tool_choice",
            )
        choice = tool_choice
    return ToolPlan(tools=[{"type": "function", "function": t["function"]} for t in tools], choice=choice,
                    named=named, parallel=True if parallel is None else bool(parallel))  # fmt: skip


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def forcing_constraint(plan: ToolPlan) -> StructuredOutputsParams | None:
    """The JSON schema that makes the output a valid call (required / named), else None."""
    fns = {t["function"]["name"]: t["function"] for t in plan.tools}
    if plan.choice == "named":
        return StructuredOutputsParams(json=_parameters(fns[plan.named]))
    if plan.choice != "required":
        return None
    call = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "arguments": _parameters(fn)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, fn in fns.items()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": call[0] if len(call) == 1 else {"anyOf": call},
        "minItems": 1,
    }
    if not plan.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


# ---- the prompt ----------------------------------------------------------------------------------
def template_uses_tools(chat_template: Any) -> bool:
    """Whether the chat template reads the `tools` variable (else it would drop the tools unseen)."""
    if isinstance(chat_template, dict):  # named templates; HF picks "tool_use" when tools are given
        return "tool_use" in chat_template or any(template_uses_tools(t) for t in chat_template.values())
    return isinstance(chat_template, str) and re.search(r"\btools\b", chat_template) is not None


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. These are the functions, one JSON signature per line, "
        f"inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\n"
        "To call one, answer with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call>, one block per call:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    )


def history_as_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """For templates that ignore tools: tools in the system message, calls and results as text."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"]
            ]  # fmt: skip
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
