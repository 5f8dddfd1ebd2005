"""SiLU-and-mul, the gated activation of the Llama MLP (one C++ op on CPU)."""

import torch
import torch.nn.functional as F
from tokenmill.kernels import cpu as cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    d = x.shape[-1] // 2
    ops = cpu_kernels.ops_for(x)
    if ops is not None and x.dim() == 2 and x.stride(1) == 1:
        out = x.new_empty(x.shape[0], d)
        ops.silu_and_mul(out, x)
        return out
    return F.silu(x[..., :d]).mul_(x[..., d:])
