"""What an engine will run, decided from its config and the model's config.json before any weight is read.

The model folder, its shape, the device and dtype, the context length, the KV bytes per token and, where
the config fixes it, the pool size; a plan that cannot run (a context longer than the model's, a split the
model or the machine cannot take, a pool that does not hold one full-length sequence) is refused here with
a message that says what to change. The engine core, every other rank and `tokenmill serve --check` all
decide with this one function, so the check refuses exactly what the engine would, before a crash-looping
pod spends minutes loading a model that cannot run.
"""

import dataclasses
import json
import pathlib
from dataclasses import dataclass

from tokenmill.engine import kv_memory, lora_memory, quant_memory
from tokenmill.engine.config import EngineConfig, check_engine_config
from tokenmill.engine.distributed.parallel_state import validate_parallel
from tokenmill.engine.gguf_header import read_gguf_header
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.model_config import ModelConfig, load_model_config
from tokenmill.engine.quant_memory import QuantizedWeights
from tokenmill.engine.worker.device import check_fp8_device, cuda_available, resolve_device, resolve_dtype

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
    # The weights as the engine will hold them (quant_memory.py: quantized checkpoints as codes on a CPU),
    # the same count the operator's sizing makes; all ranks together.
    weights: QuantizedWeights | None = None

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
    # `serve --check --device cuda` on a machine without a GPU plans for one (the operator's argv for a GPU
    # pod, checked on CI): the GPUs' count and fp8 support are the operator's to check, from its catalog.
    elsewhere = config_only and config.device.startswith("cuda") and not cuda_available()
    device = config.device if elsewhere else str(resolve_device(config.device))
    device_type = device.split(":")[0]
    validate_parallel(config, mc, device_type, count_devices=not elsewhere)
    dtype = str(resolve_dtype(config.dtype, device_type)).removeprefix("torch.")
    max_model_len = config.max_model_len or mc.max_model_len
    if max_model_len > mc.max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than this model supports ({mc.max_model_len} tokens); "
            f"use --max-model-len {mc.max_model_len} or less"
        )
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if not (path / "model.gguf").exists():  # a safetensors checkpoint: an AWQ / GPTQ one the loader can serve
        quant_memory.check_int4_parallel(json.loads((path / "config.json").read_text()), tp, str(path))
    kv_cache_dtype = kv_memory.resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    check_kv_cache_dtype(kv_cache_dtype, mc.head_dim)
    if not elsewhere:
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
        num_blocks, lora_bytes, kv_cache_dtype, model_weights(path, device_type, dtype, tp),
    )  # fmt: skip
    if num_blocks is not None:
        check_kv_pool(plan, num_blocks)
        if device_type == "cpu" and not config_only:  # `serve --check` also checks argv meant for GPU pods
            check_cpu_memory(plan, num_blocks)
    return plan


def model_weights(path: pathlib.Path, device_type: str, dtype: str, tensor_parallel: int) -> QuantizedWeights:
    """The weights' bytes as held on this device (quant_memory.py): a GGUF from its header, a safetensors
    checkpoint (AWQ / GPTQ or not) from its config.json, so `serve --check` counts a hub model without
    its weights."""
    from tokenmill.kernels.cpu_probe import probe

    # The CPU kernels that hold codes and panels need AVX2 + FMA; below that every weight is a dtype tensor.
    kernels = probe().at_least("avx2")
    codes = kernels and quant_memory.codes_held(device_type, dtype, tensor_parallel, probe().at_least("avx512_bf16"))
    gguf = path / "model.gguf"
    if gguf.exists():
        return quant_memory.gguf_weights(read_gguf_header(gguf).tensors, dtype, codes)
    return quant_memory.config_weights(json.loads((path / "config.json").read_text()), dtype, codes)


def memory_limit_bytes() -> int | None:
    """This process's memory limit: its cgroup's memory.max (a pod's limit), else the machine's MemTotal."""
    try:
        raw = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if raw != "max":
            return int(raw)
    except (OSError, ValueError):
        pass
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cpu_memory(plan: EnginePlan, num_blocks: int) -> None:
    """Refuse a CPU engine whose weights (as held) and KV pool alone exceed the memory it may use: it would
    be killed while loading or on its first long batch."""
    limit = memory_limit_bytes()
    if limit is None or plan.weights is None:
        return
    pool = num_blocks * plan.config.block_size * plan.kv_bytes_per_token
    need = plan.weights.loaded_bytes + pool
    if need > limit:
        raise ValueError(
            f"the model's weights take {plan.weights.loaded_bytes / 2**30:.2f} GiB as held in {plan.dtype} "
            f"({plan.weights.bytes_per_weight:.3f} bytes per weight) and the KV pool {pool / 2**30:.2f} GiB: "
            f"{need / 2**30:.2f} GiB, more than the {limit / 2**30:.2f} GiB this process may use; lower "
            "--kv-cache-memory or --num-kv-blocks, or serve a smaller or more quantized model"
        )


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
