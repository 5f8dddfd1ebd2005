"""Errors in OpenAI's format: {"error": {"message", "type", "param", "code"}}, for every status."""

import re
from typing import Any

from fastapi.responses import JSONResponse
from tokenmill.engine.server.protocol import ErrorInfo, ErrorResponse

# OpenAI's `type` per status; clients (and the official SDK) key their exception classes on the status.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """Raised anywhere in the serving path; rendered by the app's exception handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    info = ErrorInfo(
        message=message, type=ERROR_TYPES.get(status, "invalid_request_error"), param=param, code=code
    )
    return ErrorResponse(error=info).model_dump()


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


_PARAM_AT_START = re.compile(r"^([a-z_]+)\b")


def from_value_error(err: ValueError, known_params: set[str]) -> OpenAIError:
    """A ValueError from SamplingParams or the engine: 400, with `param` when the message names one."""
    message = str(err)
    match = _PARAM_AT_START.match(message)
    param = match.group(1) if match and match.group(1) in known_params else None
    return bad_request(message, param)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn FastAPI/pydantic validation errors into one readable message and the first bad field."""
    parts = []
    param = None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts) or "invalid request", param
