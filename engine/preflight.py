"""`tokenmill serve --check`: every check the engine makes before it reads a weight, without the weights.

The operator's plans for GPUs a CI machine does not have get their argv checked this way (e2e): the
model source resolves (for a hub model only config.json is fetched), the architecture is one we run,
max_model_len fits the model, the TP x PP split fits the model and the devices (the engine core's
own parallel_state.validate_parallel), and a KV pool sized from the arguments (per rank) holds one
full-length sequence.
Exit 0 with one summary line, or 2 with one line naming the problem.
"""

import sys

from tokenmill.engine import kv_memory
from tokenmill.engine.config import EngineConfig


def preflight(config: EngineConfig, revision: str | None = None) -> str:
    """The summary line; raises ValueError/FileNotFoundError (one line) for what the engine would refuse."""
    from tokenmill.engine.engine_core import DEFAULT_CPU_KV_CACHE_BYTES, resolve_device
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.model_loader import resolve_dtype, resolve_model
    from tokenmill.engine.model_source import parse_model_source
    from tokenmill.engine.parallel_state import validate_parallel

    source = parse_model_source(config.model, revision)
    path = resolve_model(config.model, revision, config_only=True)
    mc = load_model_config(path)
    device = resolve_device(config.device)
    validate_parallel(config, mc, device.type)  # the engine core's own check, before its weights
    dtype = str(resolve_dtype(config.dtype, device.type)).removeprefix("torch.")
    max_model_len = config.max_model_len or mc.max_model_len
    if max_model_len > mc.max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than this model supports ({mc.max_model_len} tokens); "
            f"use --max-model-len {mc.max_model_len} or less"
        )
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    kv_per_token = kv_memory.kv_bytes_per_token(
        mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, dtype, tp, pp
    )  # per rank, as the engine core sizes each rank's pool
    blocks = config.num_kv_blocks
    if blocks is None and (config.kv_cache_memory is not None or device.type != "cuda"):
        budget = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES
        blocks = kv_memory.num_kv_blocks(budget, config.block_size, kv_per_token)
    if blocks is None:
        pool = "KV pool sized at start-up from free GPU memory"
    else:
        need = kv_memory.blocks_for_tokens(max_model_len, config.block_size)
        if blocks < need:
            have = blocks * config.block_size
            raise ValueError(
                f"the KV cache holds {blocks} blocks x {config.block_size} tokens = {have} tokens, but one "
                f"sequence of max_model_len={max_model_len} needs {need} blocks; raise --num-kv-blocks to at "
                f"least {need} (or --kv-cache-memory) or lower --max-model-len to at most {have}"
            )
        pool = f"KV pool {blocks} blocks x {config.block_size} tokens = {blocks * config.block_size} tokens"
    if tp * pp > 1:
        pool += f" per rank, tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
    return (
        f"ok: {source.display} ({mc.architecture}, {mc.num_hidden_layers} layers, {mc.num_attention_heads} "
        f"heads / {mc.num_key_value_heads} KV heads), {dtype} on {device.type}, max_model_len {max_model_len}, "
        f"{pool}"
    )


def run_check(config: EngineConfig, revision: str | None = None) -> int:
    try:
        print(preflight(config, revision), flush=True)
    except (ValueError, OSError) as e:  # ModelSourceError is a ValueError; missing files are OSErrors
        print(f"tokenmill serve --check: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
