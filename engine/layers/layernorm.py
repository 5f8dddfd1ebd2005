"""RMSNorm, with the residual add fused in (one C++ op on CPU). Statistics in fp32, the normalised value
cast back before the weight multiply, as transformers computes it."""

import torch
import torch.nn.functional as F
from tokenmill.kernels import cpu as cpu_kernels
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op instead of five (pow, mean, add, rsqrt, mul): per-op overhead dominates small
        # batches on CPU. Statistics stay in fp32, as in transformers.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if h.dtype != x.dtype:
            h = h.to(x.dtype)
        return h.mul_(self.weight)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).

        The residual form adds into x in place (x must be a fresh activation the caller owns), which
        saves one [tokens, hidden] allocation per norm.
        """
        ops = cpu_kernels.ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1 and self.weight.dtype == x.dtype:
            out = torch.empty_like(x)
            if residual is None:
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            ops.add_rms_norm(out, x, residual, self.weight, self.eps)
            return out, x
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x
