"""Start-up path: what a warm `tokenmill serve` start skips or reuses, checked by what it produces."""

import copy

import torch
from tokenmill.engine.model_loader import materialize


def test_materialize_matches_to_empty_and_keeps_shared_tensors_shared() -> None:
    with torch.device("meta"):
        m = torch.nn.Module()
        m.a = torch.nn.Linear(4, 3)
        m.b = torch.nn.Linear(4, 3, bias=False)
        m.b.weight = m.a.weight  # tied, like an LM head on the embedding
        m.register_buffer("ids", torch.zeros(5, dtype=torch.int64))
        m.register_buffer("table", torch.zeros(2, 4))
    m.a.bias.requires_grad_(False)
    reference = {k: (v.shape, v.dtype) for k, v in copy.deepcopy(m).to(torch.bfloat16).state_dict().items()}
    assert m.table.dtype == torch.float32
    materialize(m, torch.bfloat16, torch.device("cpu"))
    assert m.b.weight is m.a.weight
    assert isinstance(m.a.weight, torch.nn.Parameter) and m.a.weight.requires_grad
    assert not m.a.bias.requires_grad
    got = {k: (v.shape, v.dtype) for k, v in m.state_dict().items()}
    assert got == reference  # ids stays int64, floating tensors become bf16
    assert {t.device.type for t in m.state_dict().values()} == {"cpu"}
