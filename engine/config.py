"""Engine configuration: one dataclass shared by the offline LLM, the server and the benchmarks."""

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from tokenmill.engine.kv_memory import KV_CACHE_DTYPES


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    block_size: int = 16
    # vLLM's default; on CPU a bf16 matmul runs ~2.5x more FLOP/s at 256 rows than at 64.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # explicit pool size; wins over kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: a default per device
    # vLLM's --kv-cache-dtype: auto (the model's dtype), an 8-bit cache (int8, fp8 = fp8_e4m3, fp8_e5m2),
    # or the model's dtype by name (kv_memory.KV_CACHE_DTYPES).
    kv_cache_dtype: str = "auto"
    # Integer-code weights (a Q4_0 / Q4_1 / Q8_0 GGUF) served in fp32 on an AVX2-or-newer CPU multiply
    # activations rounded to int8 per 32 values, as llama.cpp does: a decode step several times faster,
    # no longer bit for bit the fp32 model's (docs/engine.md, "int8 activations"). Off: exact.
    int8_activations: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False  # CUDA only: skip CUDA graph capture of decode steps
    # Parallelism (docs/engine.md, "Tensor and pipeline parallel"): T x P ranks, one per device.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1  # machines (LeaderWorkerSet pods) the T x P ranks spread over; the leader is node 0
    dist_port: int = 0  # leader's torch.distributed rendezvous port; 0: a free port (one node only)
    # A collective that waits longer than this means a rank hangs: the step fails and the engine exits.
    collective_timeout_s: float = 60.0
    # LoRA adapters (vLLM's flags; docs/engine.md, "LoRA adapters"): `max_loras` slots of rank up to
    # `max_lora_rank` serve one step; `max_cpu_loras` adapters stay in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's --kv-events-config as a dict (KVEventsConfig's fields); None: no KV-cache events
    kv_events_config: dict[str, Any] | None = None


MAX_LORA_RANK = 512  # vLLM's largest


def max_cpu_loras(c: EngineConfig) -> int:
    """Adapters kept in host memory: max_cpu_loras, or max_loras when unset (vLLM's default)."""
    return c.max_loras if c.max_cpu_loras is None else c.max_cpu_loras


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field, so the same --kv-events-config JSON works on either engine
    (engine/core/kv_events.py publishes; docs/serving.md, "KV-cache events")."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled, else "null" (as vLLM)
    # PUB socket: bound when it has a wildcard (`*`, `::`) or is ipc:// / inproc://, else connected to
    # (a subscriber such as llm-d's indexer binds and the engines connect to it).
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER socket answering replays of missed batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (ZeroMQ drops beyond it)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""  # first frame of every message; llm-d expects kv@<pod>@<model>


_KV_EVENTS_INT_FIELDS = ("buffer_steps", "hwm", "max_queue_size")


def parse_json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag whose value is a JSON object (--kv-events-config, --override-generation-config)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(data).__name__}")
    return data


def parse_kv_events_config(raw: str | dict[str, Any] | None) -> KVEventsConfig | None:
    """The --kv-events-config JSON (or its dict), checked field by field; None when events are off. A
    mistake names the field and what it takes."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = parse_json_object(raw, "--kv-events-config")
    if not isinstance(raw, dict):
        raise ValueError(f"--kv-events-config must be a JSON object, got {type(raw).__name__}")
    known = [f.name for f in fields(KVEventsConfig)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; the fields are {known}")
    c = KVEventsConfig(**raw)
    if not isinstance(c.enable_kv_cache_events, bool):
        raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
    if c.publisher is None:
        c.publisher = "zmq" if c.enable_kv_cache_events else "null"
    if c.publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {c.publisher!r}")
    for name in ("endpoint", "topic"):
        if not isinstance(getattr(c, name), str):
            raise ValueError(f"--kv-events-config: {name} must be a string")
    if c.replay_endpoint is not None and not isinstance(c.replay_endpoint, str):
        raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
    for name in _KV_EVENTS_INT_FIELDS:
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--kv-events-config: {name} must be a positive integer, got {value!r}")
    if c.publisher == "zmq" and not c.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events-config: endpoint must be tcp://, ipc:// or inproc://, got {c.endpoint!r}")
    if not (c.enable_kv_cache_events and c.publisher == "zmq"):
        return None
    return c


def kv_events_dict(c: KVEventsConfig | None) -> dict[str, Any] | None:
    """EngineConfig's form of a KVEventsConfig (it crosses to the engine core process as JSON)."""
    return None if c is None else asdict(c)


def check_engine_config(c: EngineConfig) -> None:
    """Refuse values no engine can run with, naming the field and what it takes."""
    if c.block_size not in (8, 16, 32, 64, 128):
        raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {c.block_size}")
    if c.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {c.max_num_seqs}")
    if c.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {c.max_num_batched_tokens}")
    if c.max_model_len is not None and c.max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {c.max_model_len}")
    if c.num_kv_blocks is not None and c.num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be at least 1, got {c.num_kv_blocks}")
    if c.kv_cache_memory is not None and c.kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {c.kv_cache_memory}")
    if c.enable_lora:
        if c.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {c.max_loras}")
        if not 1 <= c.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {c.max_lora_rank}")
        if c.max_cpu_loras is not None and c.max_cpu_loras < c.max_loras:
            raise ValueError(
                f"max_cpu_loras ({c.max_cpu_loras}) must be at least max_loras ({c.max_loras}): every adapter "
                "in a slot is also kept in host memory"
            )
    if c.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {c.dtype!r}")
    if c.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {c.kv_cache_dtype!r}")
    if parse_kv_events_config(c.kv_events_config) is not None and not c.enable_prefix_caching:
        raise ValueError(
            "KV-cache events (--kv-events-config) need prefix caching: with --no-enable-prefix-caching no block "
            "is ever cached, so there would be nothing to publish"
        )


DEFAULTS = EngineConfig()  # the one place defaults live; the CLI and LLM() read them from here

# /health and /live stall bounds (server/health.py); here so that `tokenmill serve` parses its flags
# without importing the web stack.
DEFAULT_READINESS_STALL_S = 15.0
DEFAULT_LIVENESS_STALL_S = 60.0
# The largest request body the server reads (server/body_limit.py): far above any text prompt a context
# window holds, small enough that a runaway upload cannot exhaust the API process's memory.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
