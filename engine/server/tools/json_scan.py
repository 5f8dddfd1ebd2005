"""Where the parts of a JSON text are while the model is still writing it: the end of a value, the
members of an object, the items of an array, on text that may stop anywhere.

The tool-call streamer needs positions, not values: a call's arguments are sent as the raw text the
model wrote, fragment by fragment, so what the stream sends adds up to exactly what the whole parse
returns. Nothing here validates; a whole text's validity is json.loads's job.
"""

WS = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the string whose opening quote is text[i], or None while it is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value that starts at text[i], or None while it is unfinished."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: it ends where a delimiter comes (not at the text's end)
    while j < len(text) and text[j] not in WS + ",}]":
        j += 1
    return j if j < len(text) else None


def object_members(text: str, i: int) -> dict[str, tuple[int, int | None]]:
    """The members of the object whose `{` is text[i] written so far: key -> (start of its value, end
    of it or None while unfinished). Stops at the first thing that is not JSON."""
    members: dict[str, tuple[int, int | None]] = {}
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text) or text[j] != '"':
            return members
        key_end = _string_end(text, j)
        if key_end is None:
            return members
        key = text[j + 1 : key_end - 1]
        j = skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            return members
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return members
        end = value_end(text, j)
        members[key] = (j, end)
        if end is None:
            return members
        j = skip_ws(text, end)
        if j >= len(text) or text[j] != ",":
            return members
        j += 1


def array_items(text: str, i: int) -> list[tuple[int, int | None]]:
    """The items of the array whose `[` is text[i] written so far: (start, end or None while unfinished)."""
    items: list[tuple[int, int | None]] = []
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text) or text[j] in "],":
            return items
        end = value_end(text, j)
        items.append((j, end))
        if end is None:
            return items
        j = skip_ws(text, end)
        if j >= len(text) or text[j] != ",":
            return items
        j += 1
