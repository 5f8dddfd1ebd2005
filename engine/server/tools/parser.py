"""The model's text -> OpenAI tool calls, whole or as it streams.

`auto` (Hermes): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes,
Qwen2.5, Qwen3 and the prompt server/tools/request.py writes for templates without tools). Forced outputs are
JSON a grammar shaped: `required` an array of {"name", "arguments"} objects, a named function its
arguments object.

Streaming follows OpenAI: each call's first delta carries index, id, type, name and arguments "",
then its arguments arrive in fragments as the model writes them. A call's arguments are the raw JSON
text the model wrote (not re-serialized), so the fragments add up to exactly what the whole parse
returns: `parse_tool_calls` is the streamer fed the whole text at once.

Content (auto): text before the first block is sent as it comes, except a run of whitespace (and
anything that could begin `<tool_call>`), held until something follows it. Once a block begins,
everything outside blocks is held back to the end and sent then only if it holds more than
whitespace; with no call at all the content is the whole text. A block whose JSON does not parse is
content (nothing the model wrote is lost), unless its call's name has already gone out mid-stream
(only when the output is cut, e.g. by max_tokens): a sent delta cannot be taken back, so that call
stays with the arguments sent. `parallel_tool_calls: false` keeps the first call and drops the rest.
"""

import json
import uuid
from dataclasses import dataclass, field

from tokenmill.engine.server.tools.json_scan import WS, array_items, object_members, skip_ws, value_end

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("auto", "hermes", "none")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """One piece of one call: its first (name set, arguments "") or an arguments fragment."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class _Call:
    index: int
    name_sent: bool = False
    sent: str = ""  # arguments sent so far


def _arguments(text: str, start: int, end: int | None) -> str:
    """The arguments as sent: raw JSON text for an object or array (held back trailing whitespace
    while unfinished, so what is sent stays a prefix of the final text), a string's value once whole."""
    if text[start] in "{[":
        return text[start:end] if end is not None else text[start:].rstrip(WS)
    if end is None:
        return ""
    if text[start] == '"':
        try:
            return json.loads(text[start:end])
        except json.JSONDecodeError:
            return ""
    return text[start:end]


def _call_progress(text: str, i: int, closed: bool) -> tuple[str | None, str]:
    """(name once whole, arguments so far) of the call object whose `{` is text[i]."""
    members = object_members(text, i)
    name = None
    if "name" in members:
        start, end = members["name"]
        if end is not None and text[start] == '"':
            try:
                name = json.loads(text[start:end])
            except json.JSONDecodeError:
                name = None
    key = "arguments" if "arguments" in members else "parameters" if "parameters" in members else None
    if key is None:
        return name, "{}" if closed else ""
    return name, _arguments(text, *members[key])


def _is_call(body: str) -> bool:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("name"), str)


@dataclass
class ToolCallStreamer:
    """One choice's parsing: feed() the new text, get (content to send, call deltas to send)."""

    choice: str  # auto | required | named
    named: str | None = None
    parallel: bool = True
    text: str = ""  # everything fed (forced choices are parsed from the whole text each time)
    calls: list[_Call] = field(default_factory=list)
    # auto only
    buffer: str = ""  # text not yet placed (outside or inside a block)
    block: str | None = None  # the open block's text after <tool_call>, None outside blocks
    block_call: _Call | None = None
    block_dropped: bool = False  # a second call while parallel_tool_calls is false
    blocks_began: bool = False
    held: str = ""  # whitespace before the first block, held until something follows it
    tail: str = ""  # content after the first block began, sent at the end

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.text += delta
        if self.choice == "named":
            return "", self._named(final)
        if self.choice == "required":
            return self._required(final)
        self.buffer += delta
        return self._auto(final)

    # ---- shared: what of a call has not gone out yet ------------------------------------------------
    def _call(self, k: int) -> _Call:
        while len(self.calls) <= k:
            self.calls.append(_Call(index=len(self.calls)))
        return self.calls[k]

    @staticmethod
    def _advance(call: _Call, name: str | None, arguments: str) -> list[CallDelta]:
        out = []
        if not call.name_sent:
            if name is None:
                return out
            out.append(CallDelta(call.index, name=name))
            call.name_sent = True
        if len(arguments) > len(call.sent) and arguments.startswith(call.sent):
            out.append(CallDelta(call.index, arguments=arguments[len(call.sent) :]))
            call.sent = arguments
        return out

    # ---- forced choices ------------------------------------------------------------------------------
    def _named(self, final: bool) -> list[CallDelta]:
        i = skip_ws(self.text, 0)
        if i >= len(self.text):
            return self._advance(self._call(0), self.named, "") if final else []
        end = value_end(self.text, i)
        arguments = self.text[i:end] if end is not None else self.text[i:].rstrip(WS)
        return self._advance(self._call(0), self.named, arguments)

    def _required(self, final: bool) -> tuple[str, list[CallDelta]]:
        text = self.text
        if final and not any(c.name_sent for c in self.calls):
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None
            if not isinstance(whole, list):
                return text, []  # cut short before any call went out: the text stays the content
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return "", []
        out = []
        for k, (start, end) in enumerate(array_items(text, i)):
            if text[start] != "{" or (k and not self.parallel):
                break
            out += self._advance(self._call(k), *_call_progress(text, start, end is not None))
        return "", out

    # ---- auto: Hermes blocks among content ---------------------------------------------------------
    def _content(self, piece: str) -> str:
        if self.blocks_began:
            self.tail += piece
            return ""
        text = self.held + piece
        out = text.rstrip(WS)
        self.held = text[len(out) :]
        return out

    def _auto(self, final: bool) -> tuple[str, list[CallDelta]]:
        content, out = "", []
        while True:
            if self.block is None:
                at = self.buffer.find(START)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, START)
                    content += self._content(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content += self._content(self.buffer[:at])
                self.buffer = self.buffer[at + len(START) :]
                if not self.blocks_began:
                    self.blocks_began, self.tail, self.held = True, self.held, ""
                self.block, self.block_call, self.block_dropped = "", None, False
                continue
            at = self.buffer.find(END)
            if at < 0:
                keep = 0 if final else _partial_suffix(self.buffer, END)
                self.block += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                if final:
                    out += self._close_block(closed=False)
                else:
                    out += self._block_progress()
                break
            self.block += self.buffer[:at]
            self.buffer = self.buffer[at + len(END) :]
            out += self._close_block(closed=True)
        if final:
            sent_calls = any(c.name_sent for c in self.calls)
            if not self.blocks_began:
                content += self.held
            elif not sent_calls:
                content += self.tail  # no call after all: the content is the whole text
            elif self.tail.strip(WS):
                content += self.tail.rstrip(WS)
        return content, out

    def _block_progress(self, closed: bool = False) -> list[CallDelta]:
        i = skip_ws(self.block, 0)
        if self.block_dropped or i >= len(self.block) or self.block[i] != "{":
            return []
        name, arguments = _call_progress(self.block, i, closed)
        if self.block_call is None:
            if name is None:
                return []
            if self.calls and not self.parallel:
                self.block_dropped = True
                return []
            self.block_call = self._call(len(self.calls))
        return self._advance(self.block_call, name, arguments)

    def _close_block(self, closed: bool) -> list[CallDelta]:
        body, self.block = self.block, None
        if _is_call(body):
            self.block = body  # _block_progress reads it
            out = self._block_progress(closed=True)
            self.block = None
            return out
        if self.block_call is None and not self.block_dropped:
            self.tail += START + body + (END if closed else "")
        return []


def accumulate(deltas: list[CallDelta]) -> list[dict[str, str]]:
    """Call deltas -> [{"name", "arguments"}] by index, as a client adds them up."""
    calls: list[dict[str, str]] = []
    for d in deltas:
        if d.name is not None:
            calls.append({"name": d.name, "arguments": ""})
        calls[d.index]["arguments"] += d.arguments
    return calls


def parse_tool_calls(
    text: str, choice: str, named: str | None = None, parallel: bool = True
) -> tuple[str | None, list[dict[str, str]]]:
    """(content, calls) of a finished output: the streamer fed it whole."""
    content, deltas = ToolCallStreamer(choice, named, parallel).feed(text, final=True)
    calls = accumulate(deltas)
    if not calls:
        return text, []
    return (content if content.strip(WS) else None), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
