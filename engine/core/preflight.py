"""`tokenmill serve --check`: every check the engine makes before it reads a weight, without the weights.

The operator's plans for GPUs a CI machine does not have get their argv checked this way (e2e): the
model source resolves (for a hub model only config.json is fetched), the architecture is one we run,
max_model_len fits the model, the TP x PP split fits the model and the devices, and a KV pool sized from
the arguments (per rank) holds one full-length sequence: the engine core's own plan_engine decides it.
Exit 0 with one summary line, or 2 with one line naming the problem.
"""

import sys

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.kv_memory import DTYPE_BYTES
from tokenmill.engine.quant_memory import FLOAT_GGUF


def preflight(config: EngineConfig, revision: str | None = None) -> str:
    """The summary line; raises ValueError/FileNotFoundError (one line) for what the engine would refuse."""
    from tokenmill.engine.model.source import parse_model_source
    from tokenmill.engine.worker.engine_plan import plan_engine

    source = parse_model_source(config.model, revision)
    plan = plan_engine(config, revision, config_only=True)
    mc, blocks, block_size = plan.model_config, plan.num_kv_blocks, config.block_size
    if blocks is None:
        pool = "KV pool sized at start-up from free GPU memory"
    else:
        pool = f"KV pool {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens"
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp * pp > 1:
        pool += f" per rank, tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
    w = plan.weights
    quantized = sorted(t for t in w.types if t not in FLOAT_GGUF and t not in DTYPE_BYTES)
    # The exact bytes too: the operator's status.sizing.weightsBytes is the same count (quant_memory.py).
    held = f", weights {w.loaded_bytes / 1e9:.2f} GB as held ({w.loaded_bytes} bytes, {w.bytes_per_weight:.3f} bytes per weight" + (
        f", {w.format} {'/'.join(quantized)})" if quantized else ")"
    )
    return (
        f"ok: {source.display} ({mc.architecture}, {mc.num_hidden_layers} layers, {mc.num_attention_heads} "
        f"heads / {mc.num_key_value_heads} KV heads), {plan.dtype} on {plan.device_type}, max_model_len "
        f"{plan.max_model_len}, {pool}, KV cache {plan.kv_cache_dtype} ({plan.kv_bytes_per_token} bytes/token)"
        + (f", LoRA {config.max_loras} slots of rank {config.max_lora_rank}: {plan.lora_slot_bytes} bytes per rank "
           "(lora_memory.lora_slot_bytes, the operator's number)" if config.enable_lora else "")
        + held
    )


def run_check(config: EngineConfig, revision: str | None = None) -> int:
    try:
        print(preflight(config, revision), flush=True)
    except (ValueError, OSError) as e:  # ModelSourceError is a ValueError; missing files are OSErrors
        print(f"tokenmill serve --check: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
