"""LoRARequest: which adapter a request runs under (vLLM's name and fields). Torch-free: it travels with a
request from the API process to the engine core and, as part of a step, to every parallel rank."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str  # what clients send as `model`
    # Unique per loaded adapter, > 0 (0 is the base model). It names the adapter in the slots, the host
    # cache and the prefix cache: the server gives every load a new one, so an adapter unloaded and loaded
    # again under the same name never meets blocks or weights of its earlier version.
    lora_int_id: int
    lora_path: str  # a PEFT folder: adapter_config.json and adapter_model.safetensors

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1 (0 is the base model), got {self.lora_int_id}")
