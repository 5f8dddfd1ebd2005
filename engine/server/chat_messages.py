"""OpenAI chat messages -> the plain dicts a chat template renders -> the prompt (text and token ids).
Every client mistake is a 400 naming the message, including a template that refuses to render them."""

import json
from typing import Any

from jinja2 import TemplateError
from tokenmill.engine.server.errors import bad_request
from tokenmill.engine.server.protocol import ChatMessage

SUPPORTED_ROLES = ("system", "developer", "user", "assistant", "tool")


def _tool_calls(i: int, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant's calls as templates take them: arguments parsed into an object (as vLLM passes
    them; Qwen's template writes them with `tojson`)."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls[{j}].function.name is required", "messages")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise bad_request(
                f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}", "messages"
            ) from None
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": parsed}}
        )
    return out


def validate_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the plain dicts a chat template renders; a 400 naming the bad message."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in SUPPORTED_ROLES:
            raise bad_request(
                f"messages[{i}].role {m.role!r} is not supported; use one of: {', '.join(SUPPORTED_ROLES)}",
                "messages",
            )
        if m.content is None:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}].content is required for role {m.role!r}", "messages")
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{j}] has type {part.type!r}; only text parts are supported",
                        "messages",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        # Templates know system; OpenAI's newer `developer` role means the same thing.
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    f"messages[{i}].tool_calls is only allowed on assistant messages", "messages"
                )
            entry["tool_calls"] = _tool_calls(i, m.tool_calls)
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}].tool_call_id is required for role 'tool'", "messages")
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


async def render_chat_prompt(
    engine: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """The chat template applied (in the engine's tokenizer thread): prompt text and token ids.
    Templates raise on what they refuse (e.g. roles out of order): the client's 400, not a 500."""
    try:
        return await engine.apply_chat_template(messages, add_generation_prompt, tools=tools)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
