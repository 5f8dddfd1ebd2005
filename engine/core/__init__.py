"""The engine core: one scheduling loop over the Scheduler and the Executor, in its own process.

`EngineCore` schedules, executes and updates through a Scheduler and an Executor only; only the Scheduler
and the KVCacheManager own block bookkeeping. `proc.py` is the process's busy loop; `client.py` is the one
client the front end talks to (in-process or across ZeroMQ); `wire.py` encodes the messages.

The wire types both sides import live here, in the package init (as vLLM V1 keeps its in
`vllm/v1/engine/__init__.py`), so that neither the front end nor the core imports the other's modules
for them. May import executor/, structured_output/, model/ (config resolution), the top-level leaves.
"""

from dataclasses import dataclass, field

from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower value = served first (vLLM's convention)
    # vLLM's field: requests share prefix-cache blocks only with requests that carry the same salt.
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # vLLM's field: the adapter to run under (None: the base model)


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
    # LoRA adapter name -> sequences running / waiting under it (vllm:lora_requests_info's labels)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)

