"""POST /v1/chat/completions, top to bottom: validate the messages and parameters, admit, apply the
chat template, generate, answer (one JSON body or SSE chunks)."""

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError
from starlette.background import BackgroundTask
from tokenmill.engine.entrypoints.chat_messages import validate_messages
from tokenmill.engine.entrypoints.disconnect import run_until_disconnect
from tokenmill.engine.entrypoints.engine_errors import engine_error
from tokenmill.engine.entrypoints.errors import bad_request
from tokenmill.engine.entrypoints.logprobs import TokenTexts, chat_logprobs
from tokenmill.engine.entrypoints.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from tokenmill.engine.entrypoints.request_params import chat_sampling_params, finish_params
from tokenmill.engine.entrypoints.server_state import ServerState
from tokenmill.engine.entrypoints.streaming import SSE_DONE, sse
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("tools are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(
            f"response_format type {req.response_format.get('type')!r} is not supported; only 'text'",
            "response_format",
        )


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    # 1. Everything that can be checked without the tokenizer, before the request counts as admitted.
    state.check_model(req.model)
    state.ready_engine()
    messages = validate_messages(req.messages)
    _check_unsupported(req)
    params, max_tokens_param = chat_sampling_params(req, state.max_num_seqs, state.vocab_size)

    # 2. Admit, render the prompt, fix the completion budget, start generating.
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    engine = state.admit([request_id])
    try:
        try:
            prompt, prompt_ids = await engine.apply_chat_template(messages, req.add_generation_prompt)
        except (TemplateError, ValueError) as e:
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
        finish_params(params, len(prompt_ids), state.max_model_len, "messages", max_tokens_param)
        gen = engine.generate(request_id, prompt, prompt_ids, params, arrival, req.priority or 0)
    except BaseException:
        engine.release([request_id])
        raise

    # 3. Answer.
    texts = state.extra.setdefault("token_texts", TokenTexts(state.tokenizer))
    top_k = req.top_logprobs or 0
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
