"""Which device and dtype a rank computes on: `auto` means CUDA when there is a GPU, and bf16 there and on
CPUs with fast bf16 matmuls (AMX or AVX512-BF16), fp32 elsewhere (the parity reference)."""

import torch
from tokenmill.engine import kv_memory
from tokenmill.kernels.cpu_probe import probe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV pool's torch dtype for each resolved kv_cache_dtype (kv_memory.resolve_kv_cache_dtype).
KV_CACHE_TORCH_DTYPES = {
    **DTYPES,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def check_fp8_device(kv_cache_dtype: str, device: str | torch.device) -> None:
    """Refuse an fp8 cache on a GPU without fp8 conversions, naming the way out (int8 runs everywhere)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    have = torch.cuda.get_device_capability(device)
    if not kv_memory.kv_cache_dtype_fits_gpu(kv_cache_dtype, have):
        need = ".".join(map(str, kv_memory.FP8_MIN_CUDA_CAPABILITY))
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} needs a GPU of compute capability {need} or newer (fp8 conversions); "
            f"this one is {have[0]}.{have[1]}: use --kv-cache-dtype int8 or auto"
        )


def cpu_bf16_fast() -> bool:
    """Whether this CPU (at the probe's tier) has fast bf16 matmuls: AVX512-BF16, or AMX above it."""
    return probe().at_least("avx512_bf16")


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """'auto' -> bf16 on GPU; on CPU bf16 where the CPU has AMX or AVX512-BF16 (fast bf16 GEMM), else fp32."""
    if dtype == "auto":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_bf16_fast() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, DTYPES))}; got {dtype!r}")
    return DTYPES[dtype]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu' or 'cuda'")
    return torch.device(device)
