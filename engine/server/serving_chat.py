"""POST /v1/chat/completions, top to bottom: validate (messages, parameters, tools, output constraint,
compiled before admission), admit, apply the chat template, generate, answer (one JSON body or SSE
chunks), reading tool calls out of the text where the request has tools."""

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.outputs import RequestOutput, RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.chat_messages import render_chat_prompt, validate_messages
from tokenmill.engine.server.disconnect import run_until_disconnect
from tokenmill.engine.server.engine_errors import engine_error
from tokenmill.engine.server.errors import bad_request
from tokenmill.engine.server.logprobs import TokenTexts, chat_logprobs
from tokenmill.engine.server.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    RenderResponse,
    ToolCall,
    UsageInfo,
)
from tokenmill.engine.server.request_params import chat_sampling_params, finish_params
from tokenmill.engine.server.state import ServerState
from tokenmill.engine.server.streaming import SSE_DONE, sse
from tokenmill.engine.server.structured_request import check_compiles, request_structured_outputs
from tokenmill.engine.server.tools.parser import (
    CallDelta,
    ToolCallStreamer,
    new_call_id,
    parse_tool_calls,
)
from tokenmill.engine.server.tools.request import ToolPlan, history_as_text, plan_tools


@dataclass
class ChatPlan:
    messages: list[dict[str, Any]]
    params: SamplingParams
    max_tokens_param: str  # the field that set the completion budget, for the length error to name
    tools: ToolPlan | None
    lora: LoRARequest | None = None  # the adapter `model` names (None: the base model)
    model: str = ""  # what the response reports as `model`


# ---- 1. validate ---------------------------------------------------------------------------------
async def _validate(state: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """Everything that can be checked before the request counts as admitted, the grammar included."""
    lora = state.check_model(req.model)
    state.ready_engine()
    messages = validate_messages(req.messages)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if tools is not None and tools.choice == "auto" and state.tool_call_parser == "none":
        raise bad_request(
            "tool_choice 'auto' needs a tool-call parser, and this server has none for its model's chat "
            "template; start it with --tool-call-parser hermes, or use tool_choice 'required' or a named function",
            "tool_choice",
        )
    params, max_tokens_param = chat_sampling_params(
        req, state.max_num_seqs, state.vocab_size, state.default_sampling
    )
    constraint = request_structured_outputs(req.response_format, req.structured_outputs)
    forced = tools.forced if tools is not None else None
    if forced is not None and constraint is not None:
        raise bad_request(
            f"tool_choice {tools.choice!r} constrains the output itself; drop response_format/structured_outputs",
            "tool_choice",
        )
    params.structured_outputs = forced or constraint
    param = "tool_choice" if forced else ("response_format" if req.response_format else "structured_outputs")
    await check_compiles(params.structured_outputs, state.tokenizer, param)
    return ChatPlan(messages, params, max_tokens_param, tools, lora, state.response_model(lora))


# ---- 2. render the prompt ------------------------------------------------------------------------
async def _prepare(
    state: ServerState, req: ChatCompletionRequest, engine: Any, plan: ChatPlan
) -> tuple[str, list[int]]:
    """Render the prompt (tools in the template, or as text where it ignores them) and fix the
    completion budget now that its length is known."""
    tools = plan.tools.tools if plan.tools is not None else None
    if state.template_uses_tools:
        prompt, prompt_ids = await render_chat_prompt(engine, plan.messages, req.add_generation_prompt, tools)
    else:
        messages = history_as_text(plan.messages, tools)
        prompt, prompt_ids = await render_chat_prompt(engine, messages, req.add_generation_prompt)
    finish_params(
        plan.params, len(prompt_ids), state.max_model_len, "messages", plan.max_tokens_param,
        state.default_sampling.get("max_tokens"),
    )  # fmt: skip
    return prompt, prompt_ids


async def render_chat_completion(state: ServerState, req: ChatCompletionRequest) -> RenderResponse:
    """POST /v1/chat/completions/render: what the request would run (prompt token ids and sampling
    parameters), validated exactly as a chat request, without generating."""
    plan = await _validate(state, req)
    _, prompt_ids = await _prepare(state, req, state.ready_engine(), plan)
    return RenderResponse(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", model=plan.model, token_ids=prompt_ids,
        sampling_params=plan.params.to_dict(),
    )  # fmt: skip


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    plan = await _validate(state, req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    engine = state.admit([request_id], plan.lora)  # the 429 comes before any tokenizer work
    try:
        prompt, prompt_ids = await _prepare(state, req, engine, plan)
        gen = engine.generate(
            request_id, prompt, prompt_ids, plan.params, arrival, req.priority or 0, cache_salt=req.cache_salt,
            # a full response needs only the final output (streams stay cumulative: tool parsing reads the text)
            output_kind=RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY,
            lora_request=plan.lora,
        )
    except BaseException:
        engine.release([request_id])
        raise

    texts = state.extra.setdefault("token_texts", TokenTexts(state.tokenizer))
    top_k = req.top_logprobs or 0
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(state, request_id, gen, plan, texts, top_k, include_usage),
            media_type="text/event-stream",
            background=BackgroundTask(_cleanup, engine, request_id, gen),
        )
    return await run_until_disconnect(raw, _full(state, request_id, gen, plan, texts, top_k))


async def _cleanup(engine: Any, request_id: str, gen: AsyncGenerator) -> None:
    # A stream cancelled before its first chunk never entered generate(); make sure nothing stays counted.
    await gen.aclose()
    engine.abort(request_id)


# ---- 3. answer -----------------------------------------------------------------------------------
def _usage(final: RequestOutput) -> UsageInfo:
    prompt = len(final.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in final.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _calls(text: str, tools: ToolPlan | None) -> tuple[str | None, list[dict[str, str]]]:
    """(content, calls) of a finished output."""
    if tools is None or tools.choice == "none":
        return text, []
    return parse_tool_calls(text, tools.choice, tools.named, tools.parallel)


def _finish_reason(reason: str | None, tools: ToolPlan | None, num_calls: int) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call (auto, required); a named call ends with "stop".
    if num_calls and reason == "stop" and tools is not None and tools.choice != "named":
        return "tool_calls"
    return reason


async def _full(
    state: ServerState, request_id: str, gen: AsyncGenerator, plan: ChatPlan, texts: TokenTexts, top_k: int
) -> Response:
    final: RequestOutput | None = None
    try:
        async for ro in gen:
            final = ro
    except Exception as e:
        raise engine_error(e) from None
    choices = []
    for c in final.outputs:
        content, calls = _calls(c.text, plan.tools)
        message = ChatResponseMessage(
            content=content,
            tool_calls=[ToolCall(id=new_call_id(), function=FunctionCall(**k)) for k in calls],
        )
        logprobs = None
        if plan.params.logprobs is not None and c.logprobs is not None:
            logprobs = ChatCompletionLogProbs(content=chat_logprobs(texts, c.token_ids, c.logprobs, top_k))
        choices.append(ChatCompletionResponseChoice(
            index=c.index, message=message, logprobs=logprobs,
            finish_reason=_finish_reason(c.finish_reason, plan.tools, len(calls)), stop_reason=c.stop_reason,
        ))  # fmt: skip
    body = ChatCompletionResponse(id=request_id, model=plan.model, choices=choices, usage=_usage(final))
    return Response(body.model_dump_json(), media_type="application/json")


def _tool_delta(d: CallDelta, ids: dict[int, str]) -> DeltaToolCall:
    """OpenAI's shape: a call's first delta has its id, type and name (arguments ""); then fragments."""
    if d.name is None:
        return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
    ids[d.index] = new_call_id()
    return DeltaToolCall(
        index=d.index, id=ids[d.index], type="function", function=DeltaFunctionCall(name=d.name, arguments="")
    )


async def _stream(
    state: ServerState,
    request_id: str,
    gen: AsyncGenerator,
    plan: ChatPlan,
    texts: TokenTexts,
    top_k: int,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    created = int(time.time())
    params, tools = plan.params, plan.tools
    n = params.n
    sent_text, sent_tokens = [""] * n, [0] * n
    started, finished = [False] * n, [False] * n
    call_ids: list[dict[int, str]] = [{} for _ in range(n)]
    streamers = None
    if tools is not None and tools.choice != "none":
        streamers = [ToolCallStreamer(tools.choice, tools.named, tools.parallel) for _ in range(n)]
    final: RequestOutput | None = None

    def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
        return sse(ChatCompletionStreamResponse(
            id=request_id, created=created, model=plan.model, choices=[choice]
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
                    # With tools the content may stay null (a call), as OpenAI's first chunk says.
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content=None if streamers else "")
                    ))  # fmt: skip
                done = c.finish_reason is not None
                delta, calls = c.text[len(sent_text[i]) :], []
                if streamers is not None:
                    delta, calls = streamers[i].feed(delta, done)
                new_lp = None
                if (
                    params.logprobs is not None
                    and c.logprobs is not None
                    and len(c.token_ids) > sent_tokens[i]
                ):
                    new_lp = ChatCompletionLogProbs(content=chat_logprobs(
                        texts, c.token_ids[sent_tokens[i]:], c.logprobs[sent_tokens[i]:], top_k
                    ))  # fmt: skip
                # One delta per chunk, as OpenAI sends them: content first, then each call piece; the
                # step's logprobs ride on the first chunk and finish_reason on the last.
                deltas = []
                if delta or (not calls and (new_lp is not None or done)):
                    deltas.append(DeltaMessage(content=delta or (None if streamers else "")))
                deltas += [DeltaMessage(tool_calls=[_tool_delta(d, call_ids[i])]) for d in calls]
                for k, d in enumerate(deltas):
                    last = done and k == len(deltas) - 1
                    reason = _finish_reason(c.finish_reason, tools, len(call_ids[i])) if last else None
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=i, delta=d, logprobs=new_lp if k == 0 else None, finish_reason=reason,
                        stop_reason=c.stop_reason if last else None,
                    ))  # fmt: skip
                sent_text[i], sent_tokens[i], finished[i] = c.text, len(c.token_ids), done
        if include_usage and final is not None:
            yield sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=plan.model, choices=[], usage=_usage(final)
            ))  # fmt: skip
    except Exception as e:
        # The status line has gone out already: report the failure in-band, as OpenAI does.
        yield sse(engine_error(e).body())
    yield SSE_DONE
