"""fp32 weights that are exactly integer blocks, as GGUF conversions give (shared by the code-kernel tests)."""

import torch


def quantized_weight(n: int, k: int, kind: str, seed: int) -> torch.Tensor:
    """An fp32 weight as a GGUF Q4_1 / Q8_0 tensor dequantizes to: fp16 scale (and min) per 32 of a row."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).to(torch.float16).double()
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).double()
        m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).to(torch.float16).double()
    else:
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).double()
        q[..., 3] = -127
        m = torch.zeros(n, k // 32, 1, dtype=torch.float64)
    return (d * q + m).to(torch.float32).reshape(n, k)
