"""A request's output constraint -> SamplingParams.structured_outputs, checked before admission.

Sources: OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`) and vLLM's
`structured_outputs` extra (`json`, `regex`, `choice`, `grammar`, plus `json_object`). At most one of
them per request (and not both with a forced tool choice, which sets its own). The constraint is
compiled here, in a worker thread of the API process (engine/structured_output/grammar.py, cached by spec), so
an invalid or unsupported schema is the client's 400 naming the construct, before the request queues.
"""

import asyncio
from typing import Any

from tokenmill.engine.sampling_params import StructuredOutputsParams
from tokenmill.engine.server.errors import bad_request

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")
MAX_SPEC_CHARS = 1_000_000  # a schema/grammar/regex beyond this is refused before compiling


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}",
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema is required for type json_schema: an object with name and schema",
            "response_format",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string", "response_format")
    schema = spec.get("schema", {})  # OpenAI: a missing schema means any JSON object
    if not isinstance(schema, dict):
        raise bad_request(
            f"response_format.json_schema.schema must be a JSON schema object, got {type(schema).__name__}",
            "response_format",
        )
    strict = spec.get("strict")
    if strict not in (None, True, False):
        raise bad_request(
            f"response_format.json_schema.strict must be a boolean, got {strict!r}", "response_format"
        )
    return StructuredOutputsParams(json=schema or {"type": "object"}, strict=bool(strict))


def from_extra(structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if structured_outputs is None:
        return None
    unknown = sorted(set(structured_outputs) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise bad_request(
            f"structured_outputs: unknown keys {unknown}; use {', '.join(STRUCTURED_OUTPUTS_KEYS)}",
            "structured_outputs",
        )
    try:
        return StructuredOutputsParams(**structured_outputs)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), "structured_outputs") from None


def request_structured_outputs(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, or None."""
    a, b = from_response_format(response_format), from_extra(structured_outputs)
    if a is not None and b is not None:
        raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
    return a or b


async def check_compiles(so: StructuredOutputsParams | None, tokenizer: Any, param: str) -> None:
    """Compile the constraint (cached) off the event loop; a 400 naming `param` and the construct."""
    if so is None:
        return
    spec = getattr(so, so.kind)
    if len(str(spec)) > MAX_SPEC_CHARS:
        raise bad_request(f"{param}: the {so.kind} is longer than {MAX_SPEC_CHARS} characters", param)
    try:
        from tokenmill.engine.structured_output.grammar import validate_structured_outputs
    except ImportError:  # the grammar engine is not in this build
        raise bad_request(f"{param}: structured outputs are not supported by this server", param) from None
    try:
        await asyncio.to_thread(validate_structured_outputs, so, tokenizer)
    except ValueError as e:
        # The compiler names the engine's field; say which request field held the construct.
        where = {"response_format": "response_format.json_schema.schema",
                 "tool_choice": "the function's parameters"}.get(param)  # fmt: skip
        message = str(e).replace("structured_outputs.json:", f"{where}:", 1) if where else str(e)
        raise bad_request(message, param) from None
