"""What a loaded engine holds (KV pool, limits, load time): sent from the engine core to the API process
in its READY message, so this module imports no torch."""

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineCapacity:
    """What the engine holds once loaded; exported as metrics and the startup log line."""

    num_kv_blocks: int
    block_size: int
    kv_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_concurrency: float  # sequences of max_model_len that fit at once
    model_load_seconds: float
    dtype: str
    device: str
    # Every rank of a TP x PP replica holds a pool of num_kv_blocks blocks of its own heads and layers.
    kv_bytes_per_token: int = 0  # per rank: kv_memory.kv_bytes_per_token, what the operator sizes with
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype as given (vLLM's cache_dtype label)
    kv_cache_dtype_resolved: str = ""  # what the pool holds: the model's dtype, int8, fp8_e4m3 or fp8_e5m2
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # LoRA (0 slots: off): the slots every rank holds beside its KV pool (lora_memory.lora_slot_bytes)
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_slot_bytes: int = 0
    # Seconds of each start-up phase of the engine core, in order (StartupTimer); "imports" is the core
    # process's Python imports, before model_load_seconds starts counting.
    startup_seconds: dict[str, float] = field(default_factory=dict)

    def describe_startup(self) -> str:
        """'imports 3.1s, config 0.0s, ...': where the engine core's start went."""
        return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.startup_seconds.items())

    def describe(self) -> str:
        ranks = ""
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            ranks = (
                f" per rank (tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size})"
            )
        return (
            f"KV cache{ranks}: {self.num_kv_blocks} blocks x {self.block_size} tokens = {self.kv_tokens} tokens, "
            f"{self.kv_bytes_per_token} bytes/token ({self._cache_dtype()} on {self.device}); max_model_len "
            f"{self.max_model_len}: {self.max_concurrency:.2f}x concurrency at full length; max_num_seqs "
            f"{self.max_num_seqs}" + self.describe_lora()
        )

    def describe_lora(self) -> str:
        if not self.max_loras:
            return ""
        return (
            f"; LoRA: {self.max_loras} slots of rank {self.max_lora_rank}, "
            f"{self.lora_slot_bytes / 2**20:.1f} MiB per rank beside the KV cache"
        )


    def _cache_dtype(self) -> str:
        resolved = self.kv_cache_dtype_resolved or self.dtype
        if resolved == self.dtype:
            return self.dtype
        return f"{resolved} cache, {self.dtype} model"


class StartupTimer:
    """Wall seconds per start-up phase: mark(name) closes the phase that began at the previous mark."""

    def __init__(self, start: float | None = None) -> None:
        self.last = time.monotonic() if start is None else start
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now
