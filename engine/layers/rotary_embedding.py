"""Neox-style rotary position embedding, with Llama 3's frequency scaling; on CPU one fused C++ op rotates
queries and keys in place. cos/sin are computed in fp32 and cast to the model dtype, as in transformers."""

import math
from dataclasses import dataclass

import torch
from tokenmill.engine.model_config import RopeScaling
from tokenmill.kernels import cpu as cpu_kernels


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
        cos, sin = self.tables(positions.device, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [max_position, head_dim // 2]."""
        if self._cos is None or self._cos.dtype != dtype or self._cos.device != device:
            self._build(device, dtype)
        return self._cos, self._sin

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """What every layer of one forward needs to rotate its queries and keys."""
        if cpu_kernels.ops_for(positions) is not None:
            cos, sin = self.tables(positions.device, dtype)
            return Rope(positions, cos, sin, gathered=False)
        cos, sin = self.cos_sin(positions, dtype)
        return Rope(positions, cos, sin, gathered=True)



@dataclass(slots=True)
class Rope:
    """Rotary inputs of one forward: full tables for the fused CPU op, or cos/sin gathered per token."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    gathered: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, num_heads, head_dim]: in place by the fused CPU op, else into a new tensor."""
        if not self.gathered:
            ops = cpu_kernels.load()
            ops.rotary_neox(x, self.positions, self.cos, self.sin)
            return x
        return apply_rotary(x, self.cos, self.sin)



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
