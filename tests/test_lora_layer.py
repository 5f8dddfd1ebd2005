"""The grouped and masked LoRA products (engine/layers/lora.py) against a per-row loop, for every row layout
a step can have: sorted equal groups (views only), unequal groups (padding), adapter rows not contiguous,
a slot in several runs, base rows everywhere, slots missing from the step."""

import numpy as np
import pytest
import torch
from tokenmill.engine.layers.lora import LoRASlots, LoRAStepState

LAYOUTS = {
    "sorted, equal groups": [-1, -1, 0, 0, 1, 1, 2, 2],
    "sorted, unequal groups": [-1, 2, 2, 2, 0, 1, 1],
    "base rows between": [0, -1, 1, -1, 1, 0, -1],
    "a slot in two runs": [1, 1, 0, 1, 2, 2],
    "one slot only": [-1, 3, 3, 3],
    "base only": [-1, -1, -1],
    "all slots, in order": [0, 1, 2, 3],
}


@pytest.mark.parametrize("masked", [False, True], ids=["grouped", "masked"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_product_equals_each_rows_own_adapter(layout, masked):
    torch.manual_seed(0)
    slots_of_rows = np.array(LAYOUTS[layout], dtype=np.int64)
    state = LoRAStepState(4, masked, 16, torch.float64, torch.device("cpu"))
    lora = LoRASlots(state, rank=3, fan_in=5, part_outs=(4, 3), dtype=torch.float64, device=torch.device("cpu"))
    parts = []
    for slot in range(4):
        a, b = torch.randn(5, 6, dtype=torch.float64), [torch.randn(3, n, dtype=torch.float64) for n in (4, 3)]
        lora.set_slot(slot, (a, b))
        parts.append((a, torch.block_diag(*b)))  # the product as one block-diagonal B
    x = torch.randn(len(slots_of_rows), 5, dtype=torch.float64)
    base = torch.randn(len(slots_of_rows), 7, dtype=torch.float64)
    want = base.clone()
    for i, s in enumerate(slots_of_rows):
        if s >= 0:
            want[i] += x[i] @ parts[s][0] @ parts[s][1]
    state.set_step(slots_of_rows)
    out = base.clone()
    lora.add(out, x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    if not masked and layout == "sorted, equal groups":
        assert state.dest is None and state.rows is None  # a view: nothing gathered or scattered
