"""The model's text -> OpenAI tool calls.

`hermes`: calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5,
Qwen3 and the prompt tool_request.py writes for templates without tools); the text before the first
block is the message's content. A block whose JSON does not parse stays in the content (nothing the
model wrote is lost). Forced outputs (`required`, named) are JSON the grammar shaped and are read
directly. Streaming holds back text that could be the start of `<tool_call>` and sends each call as one
OpenAI delta (index, id, type, name, arguments) once its block has closed.
"""

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("auto", "hermes", "none")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any) -> dict[str, str] | None:
    """{"name", "arguments" (a JSON string)} from a parsed block, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "name": obj["name"],
        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
    }


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, str]]]:
    """(content, calls) of a whole output; an unclosed last block counts if its JSON is complete."""
    if START not in text:
        return text, []
    content, rest = text.split(START, 1)
    calls, leftover = [], []
    for block in (START + rest).split(START)[1:]:
        body, closed, tail = block.partition(END)
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            leftover.append(START + block)
            continue
        calls.append(call)
        if closed and tail.strip():
            leftover.append(tail)
    content = content + "".join(leftover)
    return (content.strip() or None) if calls else text, calls


def parse_forced(text: str, choice: str, named: str | None) -> list[dict[str, str]]:
    """Calls from an output a grammar forced: the arguments object (named) or an array of calls."""
    if choice == "named":
        return [{"name": named, "arguments": text.strip()}]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short by max_tokens: the text stays the content
    return [c for c in (_call(i) for i in items) if c is not None] if isinstance(items, list) else []


@dataclass
class StreamedToolCalls:
    """One choice's incremental Hermes parsing: feed new text, get (content to send, completed calls)."""

    buffer: str = ""
    in_call: bool = False
    calls: list[dict[str, str]] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        self.buffer += delta
        content, done = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(START)
                if at >= 0:
                    content += self.buffer[:at]
                    self.buffer, self.in_call = self.buffer[at + len(START) :], True
                    continue
                keep = 0 if final else _partial_suffix(self.buffer, START)
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return content, done
            at = self.buffer.find(END)
            if at < 0 and not final:
                return content, done
            body = self.buffer if at < 0 else self.buffer[:at]
            self.buffer = "" if at < 0 else self.buffer[at + len(END) :]
            self.in_call = False
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                content += START + body + ("" if at < 0 else END)
            else:
                done.append(call)
                self.calls.append(call)
            if at < 0:
                return content, done


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
