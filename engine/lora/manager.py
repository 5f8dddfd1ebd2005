"""LoRAModelManager: one rank's adapter slots and its host cache of adapters (vLLM's LRU LoRA manager).

Every rank builds one and sees the same sequence of steps, each naming its adapters; `activate` then
makes the same slot choices everywhere (free slot first, else the least recently used slot the step does
not need), so rank 0 sends only the adapters and each row's adapter id, never slot numbers. Weights come
from the host cache, an LRU of `max_cpu_loras` adapters (their layout ready to copy), else from disk.
The scheduler guarantees a step never names more adapters than there are slots.
"""

import logging
from collections import OrderedDict

import numpy as np
import torch
from tokenmill.engine.distributed.parallel_state import ParallelState
from tokenmill.engine.layers.lora import LoRASlots, LoRAStepState
from tokenmill.engine.lora.peft import read_adapter
from tokenmill.engine.lora.weights import LoRAWeights, load_lora_weights
from tokenmill.engine.lora_memory import FUSED_TARGETS, lora_dtype, lora_shapes
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.model.resolve import resolve_adapter
from tokenmill.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)


class LoRAModelManager:
    def __init__(
        self,
        model: torch.nn.Module,
        mc: ModelConfig,
        par: ParallelState,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Give every decoder layer of `model` (this rank's stage and shard) its slots."""
        self.mc, self.par = mc, par
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = getattr(torch, lora_dtype(device.type, str(dtype).removeprefix("torch.")))
        self.state = LoRAStepState(max_loras, device.type == "cuda", max_rows, self.dtype, device)
        self.shapes = lora_shapes(
            mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.intermediate_size,
            par.tp_size,
        )  # fmt: skip
        self.layer_slots: list[dict[str, LoRASlots]] = []
        for layer in model.model.layers:
            slots = {
                fused: LoRASlots(self.state, max_lora_rank, fan_in, outs, self.dtype, device)
                for fused, (fan_in, outs) in self.shapes.items()
            }
            layer.self_attn.lora = {k: slots[k] for k in ("qkv_proj", "o_proj")}
            layer.mlp.lora = {k: slots[k] for k in ("gate_up_proj", "down_proj")}
            self.layer_slots.append(slots)
        model.model.lora_state = self.state
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slots in self.layer_slots for s in slots.values()
                   for t in (s.a, *s.b))  # fmt: skip

    # ---- the host cache ---------------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter's weights from the host cache, read from its folder if absent (checked first)."""
        weights = self.host.get(lora.lora_int_id)
        if weights is not None:
            self.host.move_to_end(lora.lora_int_id)
            return weights
        # A hub URI is resolved in this rank's own hub cache (downloaded there on a miss); a folder is itself.
        info = read_adapter(resolve_adapter(lora.lora_path), self.mc, self.max_lora_rank, lora.lora_name)
        weights = load_lora_weights(
            info, lora.lora_int_id, self.mc, self.par, self.max_lora_rank, self.shapes, len(self.layer_slots),
            self.dtype,
        )  # fmt: skip
        self.host[lora.lora_int_id] = weights
        in_slots = set(self.slot_ids)
        for old in list(self.host):  # oldest first; an adapter in a slot stays
            if len(self.host) <= self.max_cpu_loras:
                break
            if old not in in_slots and old != lora.lora_int_id:
                del self.host[old]
        logger.info("LoRA adapter %r (id %d) loaded from %s: rank %d, %s, %.1f MiB on this rank", lora.lora_name,
                    lora.lora_int_id, lora.lora_path, info.rank, ",".join(info.target_modules), weights.nbytes / 2**20)  # fmt: skip
        return weights

    # ---- a step -----------------------------------------------------------------------------------
    def activate(self, loras: list[LoRARequest]) -> dict[int, int]:
        """Put this step's adapters in slots; lora_int_id -> slot."""
        if len(loras) > self.max_loras:
            raise RuntimeError(f"a step names {len(loras)} LoRA adapters, more than max_loras={self.max_loras}")
        needed = {lora.lora_int_id for lora in loras}
        where = {lid: s for s, lid in enumerate(self.slot_ids) if lid is not None}
        for lora in loras:
            slot = where.get(lora.lora_int_id)
            if slot is None:
                slot = next((s for s in self.slot_lru if self.slot_ids[s] is None), None)
                if slot is None:
                    slot = next(s for s in self.slot_lru if self.slot_ids[s] not in needed)
                self._load_slot(slot, self.add_lora(lora))
                where[lora.lora_int_id] = slot
            self.slot_lru.move_to_end(slot)
        return {lid: where[lid] for lid in needed}

    def set_step(self, seq_lora_ids: np.ndarray, num_new: np.ndarray | None, loras: list[LoRARequest]) -> None:
        """Map this step's rows to slots: seq_lora_ids int64 [num_seqs] (0: base), num_new the tokens each
        sequence runs (None: one each)."""
        if not loras:
            self.state.clear()
            return
        slot_of = self.activate(loras)
        lut = np.full(int(seq_lora_ids.max()) + 1, -1, dtype=np.int64)
        for lid, slot in slot_of.items():
            lut[lid] = slot
        seq_slot = lut[seq_lora_ids]
        self.state.set_step(seq_slot if num_new is None else np.repeat(seq_slot, num_new))

    def _load_slot(self, slot: int, weights: LoRAWeights) -> None:
        for slots, layer in zip(self.layer_slots, weights.layers, strict=True):
            for fused in FUSED_TARGETS:
                slots[fused].set_slot(slot, layer.get(fused))
        self.slot_ids[slot] = weights.lora_int_id
