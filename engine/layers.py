"""Building blocks of the decoder models: RMSNorm, rotary embedding (incl. Llama 3 scaling), SiLU-and-mul.

Numerics follow transformers' Llama/Qwen code operation for operation (norm statistics in fp32, the
normalised value cast back before the weight multiply, cos/sin computed in fp32 and cast to the model
dtype), so fp32 outputs agree with transformers to rounding and bf16 outputs round the same way.
"""

import math

import torch
import torch.nn.functional as F
from tokenmill.engine.model_config import RopeScaling
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
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with Llama 3's smooth low/high-frequency scaling."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band in between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE with a cos/sin table over every position, built once per device/dtype.

    A plain object, not a module: the table is derived state, never loaded from a checkpoint.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None) -> None:
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _build(self, device: torch.device, dtype: torch.dtype) -> None:
        # Built on the CPU (the model may be constructed under a meta-device context), then moved.
        inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling)
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, head_dim // 2]
        self._cos = freqs.cos().to(device=device, dtype=dtype)
        self._sin = freqs.sin().to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim // 2] for the given positions; computed once per forward."""
        if self._cos is None or self._cos.dtype != dtype or self._cos.device != positions.device:
            self._build(positions.device, dtype)
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] -> a new contiguous tensor of the same shape."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1 = out[..., :half]
    o2 = out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])
