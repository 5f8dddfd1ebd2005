"""What the chat and completion handlers share: server state, sampling parameters, length checks,
logprob formatting, engine-error mapping, disconnect handling and SSE framing."""

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from tokenmill.engine.async_llm import AsyncLLM, QueueFullError, RequestAbortedError, RequestRejectedError
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.engine.entrypoints.errors import OpenAIError, bad_request, from_value_error
from tokenmill.engine.entrypoints.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)
from tokenmill.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_AFTER_S = 1  # what a 429 asks the client to wait; the queue drains at the engine's step rate
SAMPLING_PARAM_NAMES = {f for f in SamplingParams.__dataclass_fields__} | {
    "max_completion_tokens",
    "top_logprobs",
}


@dataclass
class ServerState:
    """Everything the handlers read; `engine` is None until the model has loaded."""

    served_model_names: list[str]
    model_root: str = ""
    api_key: str | None = None
    require_auth_for_metrics: bool = False
    engine: AsyncLLM | None = None
    metrics: Any = None  # ServerMetrics
    tokenizer: Any = None
    vocab_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0
    status: str = "loading"  # loading | ready | draining | dead | failed
    status_detail: str = "the model is loading"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist. This server serves: {', '.join(self.served_model_names)}.",
                param="model",
                code="model_not_found",
            )

    def ready_engine(self) -> AsyncLLM:
        """The engine, or a 503 (loading, draining) / 500 (dead) that says why not."""
        if self.status == "ready" and self.engine is not None:
            return self.engine
        if self.status == "dead":
            raise OpenAIError(500, self.status_detail)
        raise OpenAIError(503, self.status_detail, headers={"Retry-After": str(RETRY_AFTER_S)})

    def admit(self, request_ids: list[str]) -> AsyncLLM:
        engine = self.ready_engine()
        try:
            engine.admit(request_ids)
        except QueueFullError as e:
            raise OpenAIError(
                429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except EngineDeadError as e:
            raise engine_error(e) from None
        return engine


def engine_error(err: BaseException) -> OpenAIError:
    """Map what generate() raises to the HTTP error the client sees."""
    if isinstance(err, EngineDeadError):
        return OpenAIError(
            500, f"the engine failed and the server is shutting down: {err}", code="engine_dead"
        )
    if isinstance(err, RequestRejectedError):
        return OpenAIError(400 if err.client_error else 500, str(err))
    if isinstance(err, RequestAbortedError):
        return OpenAIError(503, str(err), code="request_aborted")
    logger.error("request failed", exc_info=err)
    return OpenAIError(500, f"internal error: {type(err).__name__}: {err}")


# ---- sampling parameters -------------------------------------------------------------------------
def build_sampling_params(
    req: Any, *, n: int, logprobs: int | None, max_tokens: int | None, max_num_seqs: int, vocab_size: int
) -> SamplingParams:
    """OpenAI + vLLM request fields -> SamplingParams; every bad value is a 400 naming the parameter."""
    if n > max_num_seqs:
        raise bad_request(f"n must be at most max_num_seqs ({max_num_seqs}) on this server, got {n}", "n")
    logit_bias: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias key {token} is not a token id in [0, {vocab_size})", "logit_bias")
        logit_bias[token] = bias
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"stop_token_ids must be token ids in [0, {vocab_size}); got {bad[:5]}", "stop_token_ids"
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kwargs: dict[str, Any] = {
        "n": n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "seed": req.seed,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens or 0,
        "ignore_eos": bool(req.ignore_eos),
        "logprobs": logprobs,
        "logit_bias": logit_bias,
        "skip_special_tokens": True if req.skip_special_tokens is None else req.skip_special_tokens,
    }
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_PARAM_NAMES) from None


def resolve_max_tokens(
    prompt_len: int, requested: int | None, max_model_len: int, prompt_param: str, max_tokens_param: str
) -> int:
    """The completion budget; a 400 naming both lengths when the prompt (plus max_tokens) does not fit."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"the prompt has {prompt_len} tokens, but this model's maximum context length (max_model_len) is "
            f"{max_model_len} tokens, which leaves no room for a completion; shorten the prompt",
            prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"this model's maximum context length (max_model_len) is {max_model_len} tokens, but "
            f"{prompt_len + requested} were requested ({prompt_len} in the prompt, {requested} for the "
            f"completion); set {max_tokens_param} to at most {room} or shorten the prompt",
            max_tokens_param,
        )
    return requested


# ---- logprobs in OpenAI's shapes -----------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table that byte-level BPE vocabularies are written in."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenTexts:
    """Token id -> (text as OpenAI shows it, exact bytes), cached. Byte-level BPE tokens can hold half a
    UTF-8 character: their text is U+FFFD but `bytes` still carries the real bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is not None:
            return hit
        text = self.tokenizer.decode([token_id])
        raw = text.encode("utf-8")
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(ch in _UNICODE_TO_BYTE for ch in piece):
                raw = bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        self.cache[token_id] = hit = (text, list(raw))
        return hit


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], top_k: int
) -> list[ChatCompletionLogProbsContent]:
    out = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text, raw = texts.get(tid)
        top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_k]
        out.append(ChatCompletionLogProbsContent(
            token=text, logprob=_finite(entry[tid]), bytes=raw,
            top_logprobs=[ChatCompletionLogProb(token=texts.get(t)[0], logprob=_finite(lp), bytes=texts.get(t)[1])
                          for t, lp in top],
        ))  # fmt: skip
    return out


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int
) -> CompletionLogProbs:
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text, _ = texts.get(tid)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(entry[tid]))
        out.top_logprobs.append({texts.get(t)[0]: _finite(lp) for t, lp in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM clamps the same way).
    return max(float(x), -9999.0)


# ---- plumbing ------------------------------------------------------------------------------------
class ClientDisconnected(Exception):
    pass


async def run_until_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await `coro` unless the client goes away first; then cancel it (which aborts the request in the
    engine). Starlette does not cancel a non-streaming handler on disconnect, so this watches for it."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientDisconnected()
    return task.result()


async def merge_async_iterators(iterators: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as their items arrive; cancelling the merge cancels them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done_marker))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else _json(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))
