"""Prometheus metrics under vLLM's names (engine/metric_names.py), label `model_name`.

Facts are born in two places: the scheduler (running, waiting, KV usage, preemptions, prefix cache,
iteration tokens, queue time), which sends SchedulerStats with every step, and the API process
(TTFT, inter-token and end-to-end latency, request lengths, finish reasons). Both are recorded here
and exported by the API process. Each server owns its registry, so in-process tests can run several.
"""

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from tokenmill.engine import metric_names as names
from tokenmill.engine.core import SchedulerStats

# vLLM's buckets, so dashboards built for it bucket the same way.
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")

# vLLM does the same: the *_created series double the scrape size and no dashboard reads them.
disable_created_metrics()


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(float(value))
        exponent += 1


class ServerMetrics:
    def __init__(
        self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, label = self.registry, [names.LABEL_MODEL]
        tokens = _token_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge(names.NUM_REQUESTS_RUNNING, "Requests in the model's running batch.")
        self.num_waiting = gauge(
            names.NUM_REQUESTS_WAITING, "Requests waiting: the scheduler's queue plus those being tokenized."
        )
        self.kv_usage = gauge(names.KV_CACHE_USAGE, "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_capacity_tokens = gauge(names.KV_CAPACITY_TOKENS, "Tokens the KV cache holds.")
        self.max_concurrency = gauge(
            names.MAX_CONCURRENCY, "Sequences of max_model_len that fit in the KV cache."
        )
        self.max_model_len = gauge(names.MAX_MODEL_LEN, "Longest sequence (prompt + output) served.")
        self.model_load_seconds = gauge(names.MODEL_LOAD_SECONDS, "Seconds the engine core took to load.")
        self._cache_info = Gauge(
            names.CACHE_CONFIG_INFO,
            "KV-cache configuration (value 1; the facts are labels).",
            [names.LABEL_MODEL, "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
            registry=r,
        )

        self.prompt_tokens = counter(names.PROMPT_TOKENS, "Prefill tokens processed.")
        self.generation_tokens = counter(names.GENERATION_TOKENS, "Tokens generated.")
        self.num_preemptions = counter(names.NUM_PREEMPTIONS, "Recompute preemptions.")
        self.prefix_cache_queries = counter(
            names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.")
        success = Counter(
            names.REQUEST_SUCCESS,
            "Finished sequences by finish reason.",
            [names.LABEL_MODEL, "finished_reason"],
            registry=r,
        )
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success = success

        self.ttft = histogram(names.TTFT, "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram(
            names.INTER_TOKEN_LATENCY, "Time between successive token outputs.", _ITL_BUCKETS
        )
        self.e2e = histogram(names.E2E_LATENCY, "Arrival to last token.", _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(names.QUEUE_TIME, "Arrival to first scheduled.", _REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            names.REQUEST_PROMPT_TOKENS, "Prompt length per request.", tokens
        )
        self.request_generation_tokens = histogram(
            names.REQUEST_GENERATION_TOKENS, "Generated tokens per request (all choices).", tokens
        )
        self.iteration_tokens = histogram(
            names.ITERATION_TOKENS,
            "Tokens scheduled per engine step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        )

        self._lora_info: Gauge | None = None
        self._lora_last_named: tuple[tuple[str, str, str], float] | None = None
        self.max_lora = 0

    def enable_lora(self, max_loras: int) -> None:
        """vllm:lora_requests_info, as vLLM declares it (no model_name label: vLLM's has none)."""
        self.max_lora = max_loras
        self._lora_info = Gauge(
            names.LORA_REQUESTS_INFO,
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        self._lora_adapters = Gauge(
            names.LORA_ADAPTER_INFO,
            "LoRA adapters this server serves (status loaded) or failed to load (status failed, with the reason).",
            [names.LABEL_MODEL, "lora_name", "status", "reason"],
            registry=self.registry,
        )

    def set_lora_adapters(self, loaded: list[str], failed: dict[str, str]) -> None:
        self._lora_adapters.clear()
        for name in loaded:
            self._lora_adapters.labels(self.model_name, name, "loaded", "").set(1)
        for name, reason in failed.items():
            self._lora_adapters.labels(self.model_name, name, "failed", reason[:500]).set(1)

    # ---- set once ------------------------------------------------------------------------------
    def set_capacity(self, capacity: object, enable_prefix_caching: bool) -> None:
        """`capacity` is the engine's EngineCapacity (duck-typed: the API process need not import torch)."""
        c = capacity
        self.kv_capacity_tokens.set(c.kv_tokens)
        self.max_concurrency.set(c.max_concurrency)
        self.max_model_len.set(c.max_model_len)
        self.model_load_seconds.set(c.model_load_seconds)
        # cache_dtype: what the pool holds (the model's dtype, int8, fp8_e4m3, fp8_e5m2), not the flag's `auto`/`fp8`.
        cache_dtype = getattr(c, "kv_cache_dtype_resolved", "") or c.dtype
        self._cache_info.labels(
            self.model_name, str(c.block_size), str(c.num_kv_blocks), cache_dtype, str(enable_prefix_caching)
        ).set(1)

    # ---- per engine step -----------------------------------------------------------------------
    def record_step(self, stats: SchedulerStats, num_new_tokens: int, num_preprocessing: int) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting + num_preprocessing)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        for _rid, waited in stats.queue_times:
            self.queue_time.observe(waited)
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)
        if self._lora_info is not None:
            self._record_lora(stats)

    def _record_lora(self, stats: SchedulerStats) -> None:
        """vLLM sets a new label set every step, value the time, and never drops one; the endpoint picker
        reads the series with the largest value: v1.5.0's extractor among all series, its older metrics
        client among those with a running or waiting adapter. Kept here: the latest series and the latest
        one that names an adapter, which both rules read exactly as they read vLLM's, without a series for
        every combination of adapters ever seen."""
        labels = (str(self.max_lora), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters))
        now = time.time()
        self._lora_info.clear()
        self._lora_info.labels(*labels).set(now)
        if labels[1] or labels[2]:
            self._lora_last_named = (labels, now)
        elif self._lora_last_named is not None:
            named, when = self._lora_last_named
            self._lora_info.labels(*named).set(when)

    def set_waiting(self, num_waiting: int) -> None:
        self.num_waiting.set(num_waiting)

    # ---- per request ---------------------------------------------------------------------------
    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_inter_token(self, gap_s: float) -> None:
        self.itl.observe(gap_s)

    def record_finished(
        self, e2e_s: float, num_prompt_tokens: int, num_generation_tokens: int, finish_reasons: list[str]
    ) -> None:
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        for reason in finish_reasons:
            child = self.request_success.get(reason)
            if child is None:
                child = self.request_success[reason] = self._success.labels(self.model_name, reason)
            child.inc()

    # ---- export --------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
