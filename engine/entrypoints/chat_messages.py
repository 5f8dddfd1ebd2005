"""OpenAI chat messages -> the plain dicts a chat template renders; a 400 naming the bad message."""

from tokenmill.engine.entrypoints.errors import bad_request
from tokenmill.engine.entrypoints.protocol import ChatMessage

SUPPORTED_ROLES = ("system", "developer", "user", "assistant")


def validate_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
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
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out
