"""A request body is read whole, up to a limit, before the routes see it: a body over the limit gets an
OpenAI-format 413 naming the limit, whether it declares its length (Content-Length, refused unread) or is
sent chunked (Transfer-Encoding: chunked, as Envoy forwards bodies after the endpoint picker has read
them), in which case it is refused as soon as the bytes received pass the limit.

Malformed chunked framing (a chunk size that is not hex, a chunk longer than it said) never reaches
this layer: uvicorn's HTTP parser answers it with a 400 and closes the connection."""

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenmill.engine.server.errors import OpenAIError, error_response


def _too_large(limit: int, what: str) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body {what} is over this server's limit of {limit} bytes (--max-request-body-bytes)",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    """Pure ASGI: reads the body before the app, replays it, then hands later messages (a client's
    disconnect, which the routes watch for) straight through."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(_too_large(self.limit, f"({int(declared)} bytes declared)"))(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: the app sees it go
                pending: list[Message] = [message]
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await error_response(_too_large(self.limit, f"(over {size} bytes so far)"))(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)
