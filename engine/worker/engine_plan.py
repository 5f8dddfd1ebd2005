"""What an engine will run, decided from its config and the model's config.json before any weight is read.

The model folder, its shape, the device and dtype, the context length, the KV bytes per token and, where
the config fixes it, the pool size; a plan that cannot run (a context longer than the model's, a split the
model or the machine cannot take, a pool that does not hold one full-length sequence) is refused here with
a message that says what to change. The engine core, every other rank and `tokenmill serve --check` all
decide with this one function, so the check refuses exactly what the engine would, before a crash-looping
pod spends minutes loading a model that cannot run.
"""

import dataclasses
import pathlib
from dataclasses import dataclass

from tokenmill.engine import kv_memory, lora_memory
from tokenmill.engine.config import EngineConfig, check_engine_config
from tokenmill.engine.distributed.parallel_state import validate_parallel
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.model_config import ModelConfig, load_model_config
from tokenmill.engine.worker.device import check_fp8_device, resolve_device, resolve_dtype

# Default KV pool on CPU when neither num_kv_blocks nor kv_cache_memory is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# On CUDA the pool takes this fraction of the memory left free after loading the weights.
CUDA_KV_CACHE_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class EnginePlan:
    config: EngineConfig  # as given, with `model` the resolved folder
    model_path: pathlib.Path
    model_config: ModelConfig
    device: str  # "cpu", "cuda" or "cuda:N" (rank 0's; other ranks take their local GPU)
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    kv_bytes_per_token: int  # per rank: its KV heads and its pipeline stage's layers
    # The pool's blocks per rank when the config fixes them (explicit, a byte budget, or the CPU default);
    # None on CUDA without either: sized from the memory free once the weights are in (Worker).
    num_kv_blocks: int | None
    # Bytes of the LoRA slots on one rank (0: LoRA off). On CUDA they are allocated before the KV pool is
    # sized from the free memory, so the pool leaves them out; an explicit pool size or budget is the pool's own.
    lora_slot_bytes: int = 0
    # The cache's dtype, resolved (kv_memory.resolve_kv_cache_dtype): the model's, or int8 / fp8_e4m3 / fp8_e5m2.
    kv_cache_dtype: str = "float32"

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def world_size(self) -> int:
        return self.config.tensor_parallel_size * self.config.pipeline_parallel_size


def plan_engine(config: EngineConfig, revision: str | None = None, *, config_only: bool = False) -> EnginePlan:
    """The plan for `config`; raises ValueError / FileNotFoundError (one line each) for what cannot run.
    config_only: resolve a hub model's config.json alone (`serve --check`), not its weights."""
    check_engine_config(config)
    path = resolve_model(config.model, revision, config_only=config_only)
    mc = load_model_config(path)
    device = str(resolve_device(config.device))
    device_type = device.split(":")[0]
    validate_parallel(config, mc, device_type)
    dtype = str(resolve_dtype(config.dtype, device_type)).removeprefix("torch.")
    max_model_len = config.max_model_len or mc.max_model_len
    if max_model_len > mc.max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than this model supports ({mc.max_model_len} tokens); "
            f"use --max-model-len {mc.max_model_len} or less"
        )
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    kv_cache_dtype = kv_memory.resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    check_kv_cache_dtype(kv_cache_dtype, mc.head_dim)
    check_fp8_device(kv_cache_dtype, device)
    kv_per_token = kv_memory.kv_bytes_per_token(
        mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, kv_cache_dtype, tp, pp
    )
    num_blocks = config.num_kv_blocks
    if num_blocks is None and (config.kv_cache_memory is not None or device_type != "cuda"):
        budget = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = kv_memory.num_kv_blocks(budget, config.block_size, kv_per_token)
    lora_bytes = 0
    if config.enable_lora:
        lora_bytes = lora_memory.lora_slot_bytes(
            mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
            mc.intermediate_size, config.max_loras, config.max_lora_rank, lora_memory.lora_dtype(device_type, dtype),
            tp, pp,
        )  # fmt: skip
    plan = EnginePlan(
        dataclasses.replace(config, model=str(path)), path, mc, device, dtype, max_model_len, kv_per_token,
        num_blocks, lora_bytes, kv_cache_dtype,
    )  # fmt: skip
    if num_blocks is not None:
        check_kv_pool(plan, num_blocks)
    return plan


def check_kv_pool(plan: EnginePlan, num_blocks: int) -> None:
    """Refuse a pool that cannot hold one sequence of max_model_len tokens, naming both ways out."""
    block_size, max_model_len = plan.config.block_size, plan.max_model_len
    need = kv_memory.blocks_for_tokens(max_model_len, block_size)
    if num_blocks < need:
        have_tokens = num_blocks * block_size
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks x {block_size} tokens = {have_tokens} tokens, but one "
            f"sequence of max_model_len={max_model_len} needs {need} blocks; raise --num-kv-blocks to at least "
            f"{need} (or --kv-cache-memory to at least {plan.kv_bytes_per_token * block_size * need / 2**20:.1f} MiB of "
            f"{plan.kv_cache_dtype}) or lower --max-model-len to at most {have_tokens}"
        )


def check_kv_cache_dtype(kv_cache_dtype: str, head_dim: int) -> None:
    """Refuse an 8-bit cache the kernels cannot lay out: its rows end in a 4-byte scale that must stay
    aligned (kernels/kv_quant.py), so head_dim must be a multiple of 4."""
    if kv_cache_dtype in kv_memory.KV_QUANT_DTYPES and head_dim % 4:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} needs head_dim a multiple of 4 (this model's is {head_dim}); "
            "use --kv-cache-dtype auto"
        )
