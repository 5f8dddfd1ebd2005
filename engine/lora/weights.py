"""One adapter's weights on one rank, in the slot layout (engine/lora_memory.py): per local layer and fused
projection, A [parts x R, in] with each part's lora_A in its rank band and B [out, parts x R] block-diagonal
(each part's lora_B, times PEFT's scale, in its rows and its band), zero elsewhere.

Tensor parallel: sharded as the base weight is (model/sharding.py). Column-parallel projections (q/k/v,
gate/up) keep A whole and take this rank's rows of B; row-parallel ones (o, down) take this rank's input
columns of A and keep B whole: each rank's x_shard @ A_shard.T is a partial sum, and its product with B is
added to the base projection's partial output before the one all-reduce that sums them.
"""

import io
import pathlib
from dataclasses import dataclass

import torch
from tokenmill.engine.distributed.parallel_state import ParallelState
from tokenmill.engine.load_memory import TensorInfo
from tokenmill.engine.lora.peft import AdapterInfo
from tokenmill.engine.lora_memory import FUSED_TARGETS, ROW_PARALLEL, lora_scaling
from tokenmill.engine.model import sharding
from tokenmill.engine.model.safetensors_stream import read_tensor
from tokenmill.engine.model_config import ModelConfig

_FUSED_OF = {module: fused for fused, parts in FUSED_TARGETS.items() for module in parts}
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass(slots=True)
class LoRAWeights:
    lora_int_id: int
    # local layer -> fused projection -> (A, B); a projection the adapter leaves alone is absent.
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for ab in layer.values() for t in ab)


def _row_offsets(mc: ModelConfig, par: ParallelState) -> dict[str, int]:
    """First row of each PEFT module's output within its fused projection on this rank."""
    q, kv, inter = sharding.local_sizes(mc, par)
    return {"q_proj": 0, "k_proj": q, "v_proj": q + kv, "o_proj": 0, "gate_proj": 0, "up_proj": inter, "down_proj": 0}


def load_lora_weights(
    info: AdapterInfo,
    lora_int_id: int,
    mc: ModelConfig,
    par: ParallelState,
    max_lora_rank: int,
    fused_shapes: dict[str, tuple[int, int, int]],
    num_local_layers: int,
    dtype: torch.dtype,
) -> LoRAWeights:
    """Read the adapter's tensors (this rank's layers and shards), scaled and laid out for the slots.
    fused_shapes: fused projection -> (parts, in, out) on this rank (lora_memory.lora_shapes)."""
    R = max_lora_rank
    offsets = _row_offsets(mc, par)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(num_local_layers)]
    files: dict[pathlib.Path, io.BufferedReader] = {}
    try:
        for (layer, module), ab in info.tensors.items():
            base_key = f"model.layers.{layer}.{_BLOCK[module]}.{module}.weight"
            local = sharding.local_name(base_key, mc, par)
            if local is None:
                continue  # another pipeline stage's layer
            local_layer = int(local.split(".")[2])
            a = _read(files, ab.a).float()
            b = _read(files, ab.b).float()
            r = a.shape[0]
            b = b * lora_scaling(info.lora_alpha, r, info.use_rslora)
            # The base weight's split: row parallel splits A's input columns, column parallel B's rows.
            if module in ROW_PARALLEL:
                a = sharding.shard_tensor(base_key, a, mc, par)
            else:
                b = sharding.shard_tensor(base_key, b, mc, par)
            fused = _FUSED_OF[module]
            parts, fan_in, fan_out = fused_shapes[fused]
            if fused not in layers[local_layer]:
                layers[local_layer][fused] = (torch.zeros(parts * R, fan_in), torch.zeros(fan_out, parts * R))
            fa, fb = layers[local_layer][fused]
            band = FUSED_TARGETS[fused].index(module) * R
            row = offsets[module]
            fa[band : band + r] = a
            fb[row : row + b.shape[0], band : band + r] = b
    finally:
        for f in files.values():
            f.close()
    cast = [{k: (a.to(dtype), b.to(dtype)) for k, (a, b) in layer.items()} for layer in layers]
    return LoRAWeights(lora_int_id, cast)


def _read(files: dict[pathlib.Path, io.BufferedReader], info: TensorInfo) -> torch.Tensor:
    f = files.get(info.file) or files.setdefault(info.file, open(info.file, "rb"))
    return read_tensor(f, info)
