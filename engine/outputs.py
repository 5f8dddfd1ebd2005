"""What the engine gives its users: RequestOutput and its CompletionOutputs, and how often they come
(RequestOutputKind). The wire types between the front end and the core are in core/__init__.py."""

import enum
from dataclasses import dataclass, field
from typing import Any

# One sampled token's logprobs: (sampled token's logprob, [(token_id, logprob), ...] top-k, best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's names). CUMULATIVE copies everything so far
    on every step (O(L) per step, O(L^2) per request); a streaming handler needs only DELTA, and a
    non-streamed one only the FINAL_ONLY output, which also never wakes its task before the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, sampled token first
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
