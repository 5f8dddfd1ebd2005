"""Data crossing the engine-core boundary (msgpack-friendly) and the user-facing outputs."""

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.sampling_params import SamplingParams

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
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower value = served first (vLLM's convention)
    # vLLM's field: requests share prefix-cache blocks only with requests that carry the same salt.
    cache_salt: str | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one sequence (choice `index` of a request) from one engine step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class SchedulerStats:
    """Facts born in the scheduler, sent with every step's outputs (metrics are exported upstream)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_preemptions: int = 0  # this step
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_scheduled_tokens: int = 0  # tokens in this step's batch
    num_compiling: int = 0  # requests whose grammar is still compiling (outside the scheduler)
    # (request_id, seconds waited) for requests first scheduled this step
    queue_times: list[tuple[str, float]] = field(default_factory=list)


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
