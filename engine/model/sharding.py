"""Which slice of each checkpoint tensor one tensor/pipeline-parallel rank holds (see models/llama.py).

The loader reads every tensor once and keeps this rank's part: whole query heads and their KV heads,
an even slice of the MLP width, matching input columns of o_proj and down_proj, a padded slice of the
vocabulary; layers and parts of other pipeline stages are skipped.
"""

import re

import torch
from tokenmill.engine.distributed.parallel_state import ParallelState, kv_head_range, layer_range, vocab_shard
from tokenmill.engine.model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_COLUMN_BY_HEADS = {"q_proj", "k_proj", "v_proj"}
_COLUMN_BY_WIDTH = {"gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}
_VOCAB = {"model.embed_tokens.weight", "lm_head.weight"}


def local_sizes(config: ModelConfig, par: ParallelState) -> tuple[int, int, int]:
    """(q rows, k/v rows each, MLP width) of this rank's fused projections."""
    kv_heads = len(kv_head_range(config.num_key_value_heads, par.tp_rank, par.tp_size))
    return (
        config.q_size // par.tp_size,
        kv_heads * config.head_dim,
        config.intermediate_size // par.tp_size,
    )


def weight_targets(config: ModelConfig, par: ParallelState) -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (our fused parameter name, first row, number of rows) within it."""
    q, kv, inter = local_sizes(config, par)
    return {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, kv),
        "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, inter),
    }


def local_target(
    key: str, config: ModelConfig, par: ParallelState, targets: dict[str, tuple[str, int, int]]
) -> tuple[str, int, int | None] | None:
    """(our parameter, first row, rows; None: the whole parameter) that checkpoint tensor `key` fills on
    this rank (targets: weight_targets'), or None when another pipeline stage holds it."""
    local = local_name(key, config, par)
    if local is None:
        return None
    parts = local.rsplit(".", 2)
    if len(parts) == 3 and parts[1] in targets:
        fused, first, rows = targets[parts[1]]
        return f"{parts[0]}.{fused}.{parts[2]}", first, rows
    return local, 0, None


def local_name(key: str, config: ModelConfig, par: ParallelState) -> str | None:
    """The parameter name key loads into on this rank (layer renumbered within the stage), or None
    when another pipeline stage holds it."""
    m = _LAYER.match(key)
    if m is not None:
        layers = layer_range(config.num_hidden_layers, par.pp_rank, par.pp_size)
        layer = int(m.group(1))
        if layer not in layers:
            return None
        return f"model.layers.{layer - layers.start}.{m.group(2)}"
    if key == "model.embed_tokens.weight":
        needed = par.is_first_stage or (par.is_last_stage and config.tie_word_embeddings)
        return key if needed else None
    if key in ("model.norm.weight", "lm_head.weight"):
        return key if par.is_last_stage else None
    return key


def shard_tensor(key: str, tensor: torch.Tensor, config: ModelConfig, par: ParallelState) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `key` (the tensor itself when it is replicated)."""
    if par.tp_size == 1:
        return tensor
    t, r = par.tp_size, par.tp_rank
    if key in _VOCAB:
        first, rows = vocab_shard(config.vocab_size, r, t)
        part = tensor[first : first + rows]
        if part.shape[0] < rows:  # the last rank's padding rows: zero logits, dropped before sampling
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part
    parts = key.rsplit(".", 2)
    if len(parts) != 3:
        return tensor
    proj, kind = parts[1], parts[2]
    hd = config.head_dim
    if proj == "q_proj":
        per = config.q_size // t
        return tensor[r * per : (r + 1) * per]
    if proj in _COLUMN_BY_HEADS:  # k_proj, v_proj
        heads = kv_head_range(config.num_key_value_heads, r, t)
        return tensor[heads.start * hd : heads.stop * hd]
    if proj in _COLUMN_BY_WIDTH:
        per = config.intermediate_size // t
        return tensor[r * per : (r + 1) * per]
    if proj in _ROW:
        if kind == "bias":  # added once: the all-reduce sums every rank's output
            return tensor if r == 0 else torch.zeros_like(tensor)
        per = tensor.shape[1] // t
        return tensor[:, r * per : (r + 1) * per]
    return tensor
