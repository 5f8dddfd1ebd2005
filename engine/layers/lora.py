"""LoRA slots of one fused projection and the grouped low-rank product that adds a step's adapter rows to
its output; LoRAStepState, shared by every projection of the model, maps the step's rows to slots.

Each projection holds, for `max_loras` slots, A [slots, parts x R, in] and B [out, slots, parts x R] (the
layout engine/lora_memory.py sizes). A step's rows carry a slot index (-1: the base model). The product
is one batched op per projection, never a pass per adapter:

- grouped (CPU): the adapter rows are scattered into a [slots in step, most rows of one slot, in] block,
  one bmm with the step's slots' A, one with their B, and the results added back at their rows. Flops are
  those of the rows' own adapters (plus padding to the busiest slot).
- masked (CUDA): x @ every slot's A at once, zeroed outside each row's own slot by a [rows, slots] mask,
  then @ every slot's B: fixed shapes, so a captured decode graph replays it with the mask as its only
  per-step input (base rows have an all-zero mask row). Its flops grow with max_loras, which a GPU at
  decode batch sizes does not notice; a CPU would.
"""

import numpy as np
import torch


class LoRAStepState:
    """The current step's rows -> slots (ModelRunner sets it before each forward)."""

    def __init__(self, max_loras: int, masked: bool, max_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.masked = masked
        # Masked mode runs on every step (a captured graph cannot skip it); its base rows add zeros.
        self.active = masked
        self.mask = torch.zeros(max_rows, max_loras, dtype=dtype, device=device) if masked else None
        self.rows = self.dest = self.slots = None
        self.num_slots = self.max_rows_per_slot = 0
        self.all_slots = False

    def set_step(self, token_slot: np.ndarray) -> None:
        """token_slot: int64 [num_tokens], each row's slot or -1."""
        if self.masked:
            self.mask.zero_()
            rows = np.flatnonzero(token_slot >= 0)
            if rows.size:
                dev = self.mask.device
                self.mask[torch.from_numpy(rows).to(dev), torch.from_numpy(token_slot[rows]).to(dev)] = 1
            return
        rows = np.flatnonzero(token_slot >= 0)
        self.active = bool(rows.size)
        if not self.active:
            return
        slot_of_row = token_slot[rows]
        slots, group, counts = np.unique(slot_of_row, return_inverse=True, return_counts=True)
        per_slot = int(counts.max())
        # Row i of group g goes to g * per_slot + (its position among the group's rows).
        order = np.argsort(group, kind="stable")
        starts = np.cumsum(counts) - counts
        position = np.empty_like(order)
        position[order] = np.arange(order.size) - np.repeat(starts, counts)
        self.rows = torch.from_numpy(rows.astype(np.int64))
        self.dest = torch.from_numpy(group.astype(np.int64) * per_slot + position)
        self.slots = torch.from_numpy(slots.astype(np.int64))
        self.num_slots, self.max_rows_per_slot = slots.size, per_slot
        self.all_slots = slots.size == self.max_loras and bool((slots == np.arange(self.max_loras)).all())

    def clear(self) -> None:
        """A step without adapter rows (grouped mode skips every projection's product)."""
        if self.masked:
            self.mask.zero_()
        else:
            self.active = False


class LoRASlots:
    """The slots of one fused projection of one layer (on this rank: its shard)."""

    def __init__(
        self, state: LoRAStepState, parts: int, rank: int, fan_in: int, fan_out: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.state = state
        self.width = parts * rank
        self.a = torch.zeros(state.max_loras, self.width, fan_in, dtype=dtype, device=device)
        self.b = torch.zeros(fan_out, state.max_loras, self.width, dtype=dtype, device=device)

    def set_slot(self, slot: int, ab: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Load an adapter's (A, B) for this projection into `slot`; None: it leaves it alone (zeros)."""
        if ab is None:
            self.a[slot].zero_()
            self.b[:, slot].zero_()
        else:
            self.a[slot].copy_(ab[0])
            self.b[:, slot].copy_(ab[1])

    def add(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [rows, out] += each adapter row's x @ A.T @ B.T (its slot's; B carries PEFT's scale)."""
        st = self.state
        if not st.active:
            return
        if st.masked:
            n, slots = x.shape[0], st.max_loras
            s = torch.nn.functional.linear(x, self.a.view(slots * self.width, -1)).view(n, slots, self.width)
            s = s * st.mask[:n, :, None]
            out += torch.nn.functional.linear(s.view(n, slots * self.width), self.b.view(self.b.shape[0], -1))
            return
        k, per = st.num_slots, st.max_rows_per_slot
        padded = x.new_zeros(k * per, x.shape[1])
        padded.index_copy_(0, st.dest, x.index_select(0, st.rows))
        a = self.a if st.all_slots else self.a.index_select(0, st.slots)  # [k, width, in]
        b = self.b if st.all_slots else self.b.index_select(1, st.slots)  # [out, k, width]
        s = torch.bmm(padded.view(k, per, -1), a.transpose(1, 2))  # [k, per, width]
        y = torch.bmm(s, b.permute(1, 2, 0))  # [k, per, out]
        out.index_add_(0, st.rows, y.view(k * per, -1).index_select(0, st.dest))
