"""LoRA slots of one fused projection and the grouped low-rank product that adds a step's adapter rows to
its output; LoRAStepState, shared by every projection of the model, maps the step's rows to slots.

Each projection holds, for `max_loras` slots, A [slots, in, parts x R] and each part's B [slots, R, out]
(the layout engine/lora_memory.py sizes). A step's rows carry a slot index (-1: the base model). The product
is one batched op per projection, never a pass per adapter:

- grouped (CPU): the adapter rows, grouped by slot, form a [slots in step, rows of the busiest slot, in]
  block, which runs through one bmm with those slots' A and one with their B; the results are added back
  at their rows. Flops are those of the rows' own adapters, plus padding to the busiest slot. The model
  runner orders a step's sequences by adapter, so the adapter rows are one contiguous range, grouped:
  with equal groups (a decode step spread evenly) the block is a view and nothing is gathered or scattered.
- masked (CUDA): x @ every slot's A at once, zeroed outside each row's own slot by a [rows, slots] mask,
  then @ every slot's B: fixed shapes, so a captured decode graph replays it with the mask as its only
  per-step input (base rows have an all-zero mask row). Its flops grow with max_loras, which a GPU at
  decode batch sizes does not notice; a CPU would.

On CPU the slots are fp32 whatever the model's dtype (lora_memory.lora_dtype): torch's bf16 bmm at these
shapes (inner dimension 16-48) ran 1.4-2.7x slower than fp32's on this machine, and the adapter rows cost
one conversion each way. A bf16 model's adapter product is then more exact than PEFT's own in bf16.
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
        self.mask = torch.zeros(max_loras, max_rows, 1, dtype=dtype, device=device) if masked else None
        # Grouped mode: adapter rows [lo, hi) when contiguous, else their indices (rows); dest: each one's
        # row in the padded block (None: the rows are the block, in order); the groups' slots, in order.
        self.lo = self.hi = 0
        self.rows: torch.Tensor | None = None
        self.dest: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.num_groups = self.per_group = 0

    def set_step(self, token_slot: np.ndarray) -> None:
        """token_slot: int64 [num_tokens], each row's slot or -1."""
        rows = np.flatnonzero(token_slot >= 0)
        if self.masked:
            self.mask.zero_()
            if rows.size:
                dev = self.mask.device
                self.mask[torch.from_numpy(token_slot[rows]).to(dev), torch.from_numpy(rows).to(dev)] = 1
            return
        self.active = bool(rows.size)
        if not self.active:
            return
        slot_of_row = token_slot[rows]
        # Groups in order of appearance: runs of one slot. Each slot in one run: the runner's order.
        starts = np.flatnonzero(np.r_[True, slot_of_row[1:] != slot_of_row[:-1]])
        run_slots = slot_of_row[starts]
        contiguous = rows[-1] - rows[0] + 1 == rows.size
        if np.unique(run_slots).size == run_slots.size:
            counts = np.diff(np.r_[starts, rows.size])
            group, slots = np.repeat(np.arange(starts.size), counts), run_slots
            position = np.arange(rows.size) - np.repeat(starts, counts)
        else:  # rows of one slot in several runs (not the runner's order): group them anyway
            slots, group, counts = np.unique(slot_of_row, return_inverse=True, return_counts=True)
            order = np.argsort(group, kind="stable")
            position = np.empty_like(order)
            position[order] = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)
        per = int(counts.max())
        in_order = contiguous and bool((counts == per).all()) and bool((np.diff(group) >= 0).all())
        self.lo, self.hi = int(rows[0]), int(rows[-1]) + 1
        self.rows = None if contiguous else torch.from_numpy(rows.astype(np.int64))
        self.dest = None if in_order else torch.from_numpy(group.astype(np.int64) * per + position)
        self.num_groups, self.per_group = slots.size, per
        all_slots = slots.size == self.max_loras and bool((slots == np.arange(self.max_loras)).all())
        self.slots = None if all_slots else torch.from_numpy(slots.astype(np.int64))

    def clear(self) -> None:
        """A step without adapter rows (grouped mode skips every projection's product)."""
        if self.masked:
            self.mask.zero_()
        else:
            self.active = False


class LoRASlots:
    """The slots of one fused projection of one layer (on this rank: its shard): A [slots, in, parts x R]
    and, per part, B [slots, R, part's out] (its columns of the fused output)."""

    def __init__(
        self, state: LoRAStepState, rank: int, fan_in: int, part_outs: tuple[int, ...], dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.state = state
        self.rank = rank
        self.a = torch.zeros(state.max_loras, fan_in, len(part_outs) * rank, dtype=dtype, device=device)
        self.b = [torch.zeros(state.max_loras, rank, n, dtype=dtype, device=device) for n in part_outs]
        self.cols = [(sum(part_outs[:i]), sum(part_outs[: i + 1])) for i in range(len(part_outs))]

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, list[torch.Tensor]] | None) -> None:
        """Load an adapter's (A [in, parts x R], each part's B [R, out]) for this projection into `slot`;
        None: it leaves this projection alone (zeros)."""
        if weights is None:
            self.a[slot].zero_()
            for b in self.b:
                b[slot].zero_()
        else:
            self.a[slot].copy_(weights[0])
            for b, part in zip(self.b, weights[1], strict=True):
                b[slot].copy_(part)

    def add(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [rows, out] += each adapter row's x @ A @ B (its slot's; B carries PEFT's scale): one shrink
        product for all parts, one expand product per part (the parts' B are not block-diagonal: that spent
        the expand's flops on zeros, 3x for q/k/v)."""
        st = self.state
        if not st.active:
            return
        R = self.rank
        if st.masked:
            n, slots = x.shape[0], st.max_loras
            s = torch.matmul(x.unsqueeze(0), self.a) * st.mask[:, :n]  # [slots, n, parts x R]
            for p, (b, (c0, c1)) in enumerate(zip(self.b, self.cols, strict=True)):
                sp = s[:, :, p * R : (p + 1) * R].transpose(0, 1).reshape(n, slots * R)
                out[:, c0:c1] += torch.matmul(sp, b.view(slots * R, -1))
            return
        k, per = st.num_groups, st.per_group
        rows = x[st.lo : st.hi] if st.rows is None else x.index_select(0, st.rows)
        rows = rows.to(self.a.dtype)  # fp32 slots under a bf16 model (CPU); no copy otherwise
        if st.dest is None:
            block = rows.view(k, per, -1)
        else:  # padding rows stay uninitialised: their outputs are never read back
            block = rows.new_empty(k * per, rows.shape[1]).index_copy_(0, st.dest, rows).view(k, per, -1)
        a = self.a if st.slots is None else self.a.index_select(0, st.slots)
        s = torch.bmm(block, a)  # [k, per, parts x R]
        for p, (b, (c0, c1)) in enumerate(zip(self.b, self.cols, strict=True)):
            b = b if st.slots is None else b.index_select(0, st.slots)
            y = torch.bmm(s[:, :, p * R : (p + 1) * R], b).view(k * per, -1)
            if st.dest is not None:
                y = y.index_select(0, st.dest)
            # Cast first: an in-place add of fp32 into bf16 ran 4-5x slower than cast-then-add here.
            y = y.to(out.dtype)
            if st.rows is None:
                out[st.lo : st.hi, c0:c1] += y
            else:
                out[:, c0:c1].index_add_(0, st.rows, y)
