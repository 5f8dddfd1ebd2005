"""One adapter's weights on one rank, in the slot layout (engine/lora_memory.py): per local layer and fused
projection, A [in, parts x R] with each part's lora_A (transposed) in its rank band, and per part
B [R, out] (its lora_B transposed, times PEFT's scale); ranks below R and parts the adapter leaves alone
are zeros.

Tensor parallel: sharded as the base weight is (model/sharding.py). Column-parallel projections (q/k/v,
gate/up) keep A whole and take this rank's rows of lora_B; row-parallel ones (o, down) take this rank's
input columns of lora_A and keep lora_B whole: each rank's x_shard @ A_shard is a partial sum, and its
product with B is added to the base projection's partial output before the one all-reduce that sums them.
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

SlotWeights = tuple[torch.Tensor, list[torch.Tensor]]  # A [in, parts x R], each part's B [R, out]


@dataclass(slots=True)
class LoRAWeights:
    lora_int_id: int
    # local layer -> fused projection -> its SlotWeights; a projection the adapter leaves alone is absent.
    layers: list[dict[str, SlotWeights]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + sum(b.numel() * b.element_size() for b in bs)
                   for layer in self.layers for a, bs in layer.values())  # fmt: skip


def load_lora_weights(
    info: AdapterInfo,
    lora_int_id: int,
    mc: ModelConfig,
    par: ParallelState,
    max_lora_rank: int,
    fused_shapes: dict[str, tuple[int, tuple[int, ...]]],
    num_local_layers: int,
    dtype: torch.dtype,
) -> LoRAWeights:
    """Read the adapter's tensors (this rank's layers and shards), scaled and laid out for the slots.
    fused_shapes: fused projection -> (in, each part's out) on this rank (lora_memory.lora_shapes)."""
    R = max_lora_rank
    layers: list[dict[str, SlotWeights]] = [{} for _ in range(num_local_layers)]
    files: dict[pathlib.Path, io.BufferedReader] = {}
    try:
        for (layer, module), ab in info.tensors.items():
            base_key = f"model.layers.{layer}.{_BLOCK[module]}.{module}.weight"
            local = sharding.local_name(base_key, mc, par)
            if local is None:
                continue  # another pipeline stage's layer
            local_layer = int(local.split(".")[2])
            a = _read(files, ab.a).float()
            b = _read(files, ab.b).float() * lora_scaling(info.lora_alpha, ab.a.shape[0], info.use_rslora)
            # The base weight's split: row parallel splits A's input columns, column parallel B's rows.
            if module in ROW_PARALLEL:
                a = sharding.shard_tensor(base_key, a, mc, par)
            else:
                b = sharding.shard_tensor(base_key, b, mc, par)
            fused = _FUSED_OF[module]
            fan_in, outs = fused_shapes[fused]
            if fused not in layers[local_layer]:
                layers[local_layer][fused] = (torch.zeros(fan_in, len(outs) * R), [torch.zeros(R, n) for n in outs])
            fa, fbs = layers[local_layer][fused]
            part = FUSED_TARGETS[fused].index(module)
            r = a.shape[0]
            fa[:, part * R : part * R + r] = a.T
            fbs[part][:r] = b.T
    finally:
        for f in files.values():
            f.close()
    cast = [{k: (a.to(dtype), [b.to(dtype) for b in bs]) for k, (a, bs) in layer.items()} for layer in layers]
    return LoRAWeights(lora_int_id, cast)


def _read(files: dict[pathlib.Path, io.BufferedReader], info: TensorInfo) -> torch.Tensor:
    f = files.get(info.file) or files.setdefault(info.file, open(info.file, "rb"))
    return read_tensor(f, info)
