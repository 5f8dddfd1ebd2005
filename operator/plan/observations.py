"""What the observe stage hands the plan, as plain values: the Hub's answer about a model and the engine
pods' readings. Defined here, below both, so that the pure plan never imports a reader (the readers in
observe/ fill these in)."""

from dataclasses import dataclass, field

TOTAL = "*"  # key of a reading that covers all pods (a custom Prometheus query without a pod label)


class HubError(Exception):
    """A lookup that failed; `reason` is the condition reason, the message names the repo."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class HubModel:
    repo_id: str
    revision: str  # as asked (branch, tag or commit); "main" when the URI has none
    commit: str  # the commit sha it resolved to
    gated: bool
    weights_bytes: int | None  # bytes of the safetensors files the engine loads
    parameters: int | None  # from the safetensors metadata, when the Hub has it
    config: dict | None = None  # config.json, fetched only when asked for


@dataclass(frozen=True, slots=True)
class HubAnswer:
    """One lookup of an hf:// model: what the Hub said, or why it said nothing."""

    with_config: bool  # config.json was asked for: sizing cannot do without it
    model: HubModel | None = None  # None with no error: not asked (a token the operator may not read)
    error: HubError | None = None


@dataclass(slots=True)
class PodReading:
    waiting: float = 0.0
    running: float = 0.0
    timestamp: float | None = None  # sample time (Prometheus); None = read just now
    capacity: dict = field(default_factory=dict)  # status.sizing.measured keys
    prompt_tokens: float | None = None  # vllm:prompt_tokens_total (pod scrapes): a change is a request
    # tokenmill:lora_adapter_info (pod scrapes): adapter name -> (loaded | failed, the failure's reason)
    lora: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def queue_depth(self) -> float:
        return self.waiting + self.running


@dataclass(frozen=True, slots=True)
class EngineReadings:
    """The ready serving pods of one pass and what their engines report."""

    ready: list[dict]  # ready pods that serve HTTP (LeaderWorkerSet workers serve no metrics)
    readings: dict[str, PodReading] = field(default_factory=dict)  # by pod name, or TOTAL
    error: str | None = None  # why nothing could be read (Prometheus down, ...)
    measured: dict = field(default_factory=dict)  # the capacity they report, as status.sizing.measured
    # Routed services: the requests the router's flow control holds (None: no router, or unreadable).
    router_queue: float | None = None
    router_error: str | None = None
