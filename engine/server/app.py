"""The FastAPI app: OpenAI routes, tokenize/detokenize, health (/health readiness, /live liveness: see
health.py), metrics, version; auth; OpenAI-format
errors for every failure (FastAPI's 422 validation errors become 400s, as OpenAI answers them)."""

import asyncio
import hmac
import importlib.metadata
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from tokenmill.engine.server.body_limit import BodyLimitMiddleware
from tokenmill.engine.server.chat_messages import render_chat_prompt, validate_messages
from tokenmill.engine.server.disconnect import ClientDisconnected
from tokenmill.engine.server.errors import OpenAIError, bad_request, error_response, validation_message
from tokenmill.engine.server.health import HealthConfig, liveness, readiness
from tokenmill.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    RenderResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from tokenmill.engine.server.serving_chat import create_chat_completion, render_chat_completion
from tokenmill.engine.server.serving_completion import create_completion, render_completion
from tokenmill.engine.server.state import ServerState


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class AuthMiddleware:
    """Bearer-key check before anything else runs (even before the body is parsed), so a client
    without the key learns that first. Pure ASGI: it does not wrap streaming responses."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    def _protected(self, path: str) -> bool:
        return (
            path.startswith("/v1/")
            or path in ("/tokenize", "/detokenize", "/reset_prefix_cache")
            or (path == "/metrics" and self.state.require_auth_for_metrics)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.state.api_key
        if scope["type"] == "http" and key and self._protected(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                err = OpenAIError(
                    401,
                    "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    state: ServerState,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[Any]] | None = None,
    health_config: HealthConfig | None = None,
) -> FastAPI:
    health_cfg = health_config or HealthConfig()
    app = FastAPI(title="tokenmill", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tokenmill = state
    # The last added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, limit=state.max_request_body_bytes)
    app.add_middleware(AuthMiddleware, state=state)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_req: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(list(exc.errors()))
        return error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> Response:
        message = (
            f"{exc.detail}: {req.method} {req.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        )
        return error_response(OpenAIError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_req: Request, _exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def _internal_error(_req: Request, exc: Exception) -> Response:
        return error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}"))

    # ---- OpenAI ------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, req, raw)

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(req: ChatCompletionRequest) -> RenderResponse:
        return await render_chat_completion(state, req)

    @app.post("/v1/completions/render")
    async def completions_render(req: CompletionRequest) -> list[RenderResponse]:
        return await render_completion(state, req)

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [
            ModelCard(id=name, root=state.model_root, max_model_len=state.max_model_len or None)
            for name in state.served_model_names
        ]
        if state.lora is not None:  # adapters, with their base model as parent (vLLM's listing)
            cards += [
                ModelCard(id=lora.lora_name, root=lora.lora_path, parent=state.model_name,
                          max_model_len=state.max_model_len or None)
                for lora in state.lora.adapters.values()
            ]  # fmt: skip
        return ModelList(data=cards)

    # ---- LoRA adapters at run time (vLLM's routes; server/lora.py) --------------------------------
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        serving = _runtime_lora(state)
        await asyncio.to_thread(serving.load, req.lora_name, req.lora_path, set(state.served_model_names))
        state.metrics.set_lora_adapters(list(serving.adapters), serving.failed)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        serving = _runtime_lora(state)
        serving.unload(req.lora_name)
        state.metrics.set_lora_adapters(list(serving.adapters), serving.failed)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # ---- tokenizer -------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        state.check_model(req.model)
        engine = state.ready_engine()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            # The same checks and the same 400s as a chat request (a template error included).
            _, tokens = await render_chat_prompt(
                engine, validate_messages(req.messages), req.add_generation_prompt
            )
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await engine.encode(req.prompt, add_special)
        return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(req.model)
        engine = state.ready_engine()
        bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(f"tokens must be token ids in [0, {state.vocab_size}); got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=await engine.decode(req.tokens))

    # ---- operations ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return readiness(state, health_cfg)

    @app.get("/live")
    async def live() -> Response:
        return liveness(state, health_cfg)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        """vLLM's endpoint: forget every cached KV block (an AllBlocksCleared KV event). As in vLLM, only
        while no request holds blocks; otherwise a 409 and nothing changes."""
        engine = state.ready_engine()
        if not await engine.reset_prefix_cache():
            raise OpenAIError(
                409,
                "the prefix cache was not reset: running requests hold KV blocks; retry when the engine is idle",
            )
        return {"reset": True}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return JSONResponse({"status": state.status, "detail": state.status_detail}, status_code=503)
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _runtime_lora(state: ServerState) -> Any:
    """The server's LoRAServing when adapters may change at run time, else the 4xx that says how to allow it."""
    if state.lora is None:
        if state.status != "ready":
            state.ready_engine()  # 503 while loading: adapters are registered at the end of start-up
        raise OpenAIError(400, "this server serves no LoRA adapters: start it with --enable-lora")
    if not state.lora.allow_runtime_updates:
        raise OpenAIError(
            404,
            "loading and unloading LoRA adapters at run time is off: start the server with "
            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
            code="not_found",
        )
    return state.lora
