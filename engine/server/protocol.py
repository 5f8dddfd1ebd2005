"""OpenAI-shaped request and response schemas (pydantic), kept apart from the serving logic.

Requests accept unknown fields and ignore them (clients send `user`, `metadata`, `store`, ...); fields
that would change the meaning of a request and that we do not implement (suffix, best_of != n) are
refused by the serving code with a 400 that names them.
Ranges are checked by SamplingParams, the one place that knows them.
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# Integers a client sends must fit the engine's int64 tensors and the msgpack wire: an out-of-range value
# is the client's 400, never an engine crash. Python's json module also accepts NaN and Infinity, which
# allow_inf_nan=False turns away.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- errors ------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces -----------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingExtras(OpenAIBaseModel):
    """vLLM's extra sampling parameters, accepted on both endpoints (top level or via extra_body)."""

    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: Int64 | None = None  # lower is served first (vLLM's convention); default 0
    # Requests share prefix-cache blocks only with requests carrying the same salt (vLLM's field): a
    # tenant's secret salt keeps others from learning its prompts through cache-hit timing.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)


# ---- chat --------------------------------------------------------------------------------------
class ChatContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, in OpenAI's shape
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingExtras):
    model: str | None = None
    messages: list[ChatMessage]
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    n: Int64 | None = 1
    presence_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object
    user: str | None = None
    add_generation_prompt: bool = True


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _OmitNone(OpenAIBaseModel):
    # A call's fragments carry only index and arguments, as OpenAI sends them: the openai client adds
    # deltas up key by key and takes a present "type": null as the call's new type.
    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- completions -------------------------------------------------------------------------------
class CompletionRequest(SamplingExtras):
    model: str | None = None
    # A text, a list of texts, a list of token ids, or a list of lists of token ids.
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    best_of: Int64 | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Int64 | None = None
    max_tokens: Int64 | None = 16  # OpenAI's default for completions
    n: Int64 | None = 1
    presence_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize, detokenize --------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name decides


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class RenderResponse(OpenAIBaseModel):
    """What /v1/chat/completions/render and /v1/completions/render answer (one per prompt): the
    prompt's token ids and the sampling parameters the request would run with, as vLLM's token-in
    GenerateRequest; nothing is generated."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
