"""POST /v1/completions: prompts as text, a list of texts, token ids, or a list of token-id lists.

Each prompt is one engine request; its n choices come back as choice indexes prompt_index * n + i,
as vLLM and OpenAI number them.
"""

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.outputs import RequestOutput, RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.disconnect import run_until_disconnect
from tokenmill.engine.server.engine_errors import engine_error
from tokenmill.engine.server.errors import bad_request
from tokenmill.engine.server.logprobs import TokenTexts, completion_logprobs
from tokenmill.engine.server.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    RenderResponse,
    UsageInfo,
)
from tokenmill.engine.server.request_params import completion_sampling_params, finish_params
from tokenmill.engine.server.state import ServerState
from tokenmill.engine.server.streaming import SSE_DONE, merge_async_iterators, sse
from tokenmill.engine.server.structured_request import check_compiles, request_structured_outputs


def split_prompts(prompt: Any) -> list[str | list[int]]:
    """The four accepted shapes -> a list of prompts, each a text or a list of token ids."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


async def _validate(
    state: ServerState, req: CompletionRequest
) -> tuple[list[str | list[int]], SamplingParams, LoRARequest | None]:
    """Everything that can be checked before the request counts as admitted, the grammar included; the
    adapter `model` names (None: the base model)."""
    lora = state.check_model(req.model)
    state.ready_engine()
    prompts = split_prompts(req.prompt)
    params = completion_sampling_params(req, state.max_num_seqs, state.vocab_size, state.default_sampling)
    params.structured_outputs = request_structured_outputs(req.response_format, req.structured_outputs)
    param = "response_format" if req.response_format else "structured_outputs"
    await check_compiles(params.structured_outputs, state.tokenizer, param)
    return prompts, params, lora


async def _prepare(
    state: ServerState, req: CompletionRequest, engine: Any, prompts: list, base_params: SamplingParams
) -> list[tuple[str | None, list[int], SamplingParams]]:
    """Per prompt: its text (None for token ids unless echoed), token ids, and parameters with the
    completion budget fixed for its length."""
    out = []
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            text, token_ids = prompt, await engine.encode(prompt)
        else:
            if not all(0 <= t < state.vocab_size for t in prompt):
                raise bad_request(f"{where} holds token ids outside [0, {state.vocab_size})", "prompt")
            token_ids = prompt
            text = await engine.decode(prompt) if req.echo else None
        if not token_ids:
            raise bad_request(f"{where} is empty (0 tokens)", "prompt")
        params = finish_params(
            SamplingParams.from_dict(base_params.to_dict()), len(token_ids), state.max_model_len,
            "prompt", "max_tokens", state.default_sampling.get("max_tokens"),
        )  # fmt: skip
        out.append((text, token_ids, params))
    return out


async def render_completion(state: ServerState, req: CompletionRequest) -> list[RenderResponse]:
    """POST /v1/completions/render: one entry per prompt (token ids, sampling parameters), validated
    exactly as a completion request, without generating."""
    prompts, base_params, lora = await _validate(state, req)
    prepared = await _prepare(state, req, state.ready_engine(), prompts, base_params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    return [
        RenderResponse(
            request_id=rid, model=state.response_model(lora), token_ids=token_ids, sampling_params=params.to_dict()
        )
        for rid, (_, token_ids, params) in zip(ids, prepared, strict=True)
    ]


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    # 1. Check, then admit every prompt as one (the 429 comes before any tokenizer work).
    prompts, base_params, lora = await _validate(state, req)
    model = state.response_model(lora)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    arrival = time.monotonic()
    engine = state.admit(ids, lora)
    # 2. Tokenize, start generating.
    try:
        prepared = await _prepare(state, req, engine, prompts, base_params)
        gens = [
            engine.generate(
                rid, text, token_ids, params, arrival, req.priority or 0, cache_salt=req.cache_salt,
                # a stream sends what is new each step; a full response needs only the final output
                output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
                lora_request=lora,
            )
            for rid, (text, token_ids, params) in zip(ids, prepared, strict=True)
        ]
        prompt_texts = [text if req.echo else "" for text, _, _ in prepared]
    except BaseException:
        engine.release(ids)
        raise

    # 3. Answer.
    texts = state.extra.setdefault("token_texts", TokenTexts(state.tokenizer))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(model, request_id, gens, prompt_texts, base_params, texts, include_usage),
            media_type="text/event-stream",
            background=BackgroundTask(_cleanup, engine, ids, gens),
        )
    return await run_until_disconnect(raw, _full(model, request_id, gens, prompt_texts, base_params, texts))


async def _cleanup(engine: Any, ids: list[str], gens: list[AsyncGenerator]) -> None:
    for rid, gen in zip(ids, gens, strict=False):
        await gen.aclose()
        engine.abort(rid)
    engine.release(ids)


def _usage(finals: list[RequestOutput | None]) -> UsageInfo:
    prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
    completion = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _full(
    model: str,
    request_id: str,
    gens: list[AsyncGenerator],
    prompt_texts: list[str],
    params: SamplingParams,
    texts: TokenTexts,
) -> Response:
    finals: list[RequestOutput | None] = [None] * len(gens)
    try:
        async for i, ro in merge_async_iterators(gens):
            finals[i] = ro
    except Exception as e:
        raise engine_error(e) from None
    choices = []
    for p, final in enumerate(finals):
        for c in final.outputs:
            prefix = prompt_texts[p]
            choices.append(CompletionResponseChoice(
                index=p * params.n + c.index,
                text=prefix + c.text,
                logprobs=completion_logprobs(texts, c.token_ids, c.logprobs, len(prefix))
                if params.logprobs is not None and c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            ))  # fmt: skip
    body = CompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(finals))
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(
    model: str,
    request_id: str,
    gens: list[AsyncGenerator],
    prompt_texts: list[str],
    params: SamplingParams,
    texts: TokenTexts,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    created = int(time.time())
    n = params.n
    total = len(gens) * n
    sent_chars = [0] * total  # text already streamed per choice (the outputs are deltas)
    started, finished = [False] * total, [False] * total
    finals: list[RequestOutput | None] = [None] * len(gens)
    try:
        async for p, ro in merge_async_iterators(gens):
            finals[p] = ro
            for c in ro.outputs:
                i = p * n + c.index
                if finished[i]:
                    continue
                prefix = "" if started[i] else prompt_texts[p]  # echo: the prompt leads the first chunk
                started[i] = True
                done = c.finish_reason is not None
                new_lp = None
                if params.logprobs is not None and c.logprobs is not None and c.token_ids:
                    new_lp = completion_logprobs(
                        texts, c.token_ids, c.logprobs, len(prompt_texts[p]) + sent_chars[i]
                    )
                if prefix or c.text or new_lp is not None or done:
                    yield sse(CompletionStreamResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionResponseChoice(
                            index=i, text=prefix + c.text, logprobs=new_lp, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason if done else None,
                        )],
                    ))  # fmt: skip
                sent_chars[i] += len(c.text)
                finished[i] = done
        if include_usage:
            prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
            completion = sum(f.metrics.get("num_generation_tokens", 0) for f in finals if f is not None)
            usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            yield sse(CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[], usage=usage
            ))  # fmt: skip
    except Exception as e:
        yield sse(engine_error(e).body())
    yield SSE_DONE
