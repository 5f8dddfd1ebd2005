"""POST /v1/chat/completions: validate, apply the chat template, generate, answer (JSON or SSE)."""

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError
from starlette.background import BackgroundTask
from tokenmill.engine.entrypoints.errors import bad_request, from_value_error
from tokenmill.engine.entrypoints.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from tokenmill.engine.entrypoints.serving_common import (
    SAMPLING_PARAM_NAMES,
    SSE_DONE,
    ServerState,
    TokenTexts,
    build_sampling_params,
    chat_logprobs,
    engine_error,
    resolve_max_tokens,
    run_until_disconnect,
    sse,
)
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams

SUPPORTED_ROLES = ("system", "developer", "user", "assistant")
MAX_TOP_LOGPROBS = 20


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


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("tools are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(
            f"response_format type {req.response_format.get('type')!r} is not supported; only 'text'",
            "response_format",
        )


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    state.ready_engine()
    messages = validate_messages(req.messages)
    _check_unsupported(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
            )
    top_k = req.top_logprobs or 0
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    n = 1 if req.n is None else req.n
    params = build_sampling_params(
        req,
        n=n,
        logprobs=top_k if req.logprobs else None,
        max_tokens=requested,
        max_num_seqs=state.max_num_seqs,
        vocab_size=state.vocab_size,
    )

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    engine = state.admit([request_id])
    try:
        try:
            prompt, prompt_ids = await engine.apply_chat_template(messages, req.add_generation_prompt)
        except (TemplateError, ValueError) as e:
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
        params.max_tokens = resolve_max_tokens(
            len(prompt_ids), requested, state.max_model_len, "messages", max_tokens_param
        )
        try:
            params.verify()
        except ValueError as e:
            raise from_value_error(e, SAMPLING_PARAM_NAMES) from None
        gen = engine.generate(request_id, prompt, prompt_ids, params, arrival, req.priority or 0)
    except BaseException:
        engine.release([request_id])
        raise

    texts = state.extra.setdefault("token_texts", TokenTexts(state.tokenizer))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(state, request_id, gen, params, texts, top_k, include_usage),
            media_type="text/event-stream",
            background=BackgroundTask(_cleanup, engine, request_id, gen),
        )
    return await run_until_disconnect(raw, _full(state, request_id, gen, params, texts, top_k))


async def _cleanup(engine: Any, request_id: str, gen: AsyncGenerator) -> None:
    # A stream cancelled before its first chunk never entered generate(); make sure nothing stays counted.
    await gen.aclose()
    engine.abort(request_id)


def _usage(final: RequestOutput) -> UsageInfo:
    prompt = len(final.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in final.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _full(
    state: ServerState,
    request_id: str,
    gen: AsyncGenerator,
    params: SamplingParams,
    texts: TokenTexts,
    top_k: int,
) -> Response:
    final: RequestOutput | None = None
    try:
        async for ro in gen:
            final = ro
    except Exception as e:
        raise engine_error(e) from None
    choices = [
        ChatCompletionResponseChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=ChatCompletionLogProbs(content=chat_logprobs(texts, c.token_ids, c.logprobs, top_k))
            if params.logprobs is not None and c.logprobs is not None
            else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in final.outputs
    ]
    body = ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=_usage(final))
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(
    state: ServerState,
    request_id: str,
    gen: AsyncGenerator,
    params: SamplingParams,
    texts: TokenTexts,
    top_k: int,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    created = int(time.time())
    n = params.n
    sent_text, sent_tokens = [""] * n, [0] * n
    started, finished = [False] * n, [False] * n
    final: RequestOutput | None = None

    def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
        return sse(ChatCompletionStreamResponse(
            id=request_id, created=created, model=state.model_name, choices=[choice]
        ))  # fmt: skip

    try:
        async for ro in gen:
            final = ro
            for c in ro.outputs:
                i = c.index
                if finished[i]:
                    continue
                if not started[i]:
                    started[i] = True
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    ))  # fmt: skip
                delta = c.text[len(sent_text[i]) :]
                new_lp = None
                if (
                    params.logprobs is not None
                    and c.logprobs is not None
                    and len(c.token_ids) > sent_tokens[i]
                ):
                    new_lp = ChatCompletionLogProbs(content=chat_logprobs(
                        texts, c.token_ids[sent_tokens[i]:], c.logprobs[sent_tokens[i]:], top_k
                    ))  # fmt: skip
                done = c.finish_reason is not None
                if delta or new_lp is not None or done:
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(content=delta), logprobs=new_lp,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason if done else None,
                    ))  # fmt: skip
                sent_text[i], sent_tokens[i], finished[i] = c.text, len(c.token_ids), done
        if include_usage and final is not None:
            yield sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=state.model_name, choices=[], usage=_usage(final)
            ))  # fmt: skip
    except Exception as e:
        # The status line has gone out already: report the failure in-band, as OpenAI does.
        yield sse(engine_error(e).body())
    yield SSE_DONE
