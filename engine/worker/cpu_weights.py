"""How a rank's loaded weights become what the CPU kernels read, decided once per rank (WeightPlan) and
carried out once (prepare_weights).

A bf16 CPU model whose checkpoint is all fp32 (a GGUF conversion) is loaded in fp32 so that each weight's
integer codes can be found bit for bit; then the model is cast to bf16 and its small batches run from the
codes (cpu_gemm_policy.bf16_codes_wanted). An fp32 CPU model packs its weights for the fp32 kernel (codes
where lossless, fp32 panels otherwise); a bf16 one also prepacks them for oneDNN. The codes found are kept
on disk between starts (model/weight_codes_cache.py) when one rank holds the whole model.
"""

import ctypes
import pathlib
from dataclasses import dataclass

import torch
from tokenmill.engine.layers.cpu_gemm_policy import (
    bf16_codes_wanted,
    can_prepack,
    cpu_linear_mode,
    fp32_linear_ops,
)
from tokenmill.engine.layers.weight_codes import CodesCache
from tokenmill.engine.model.loader import checkpoint_is_float32
from tokenmill.kernels import cpu as cpu_kernels


@dataclass(frozen=True, slots=True)
class WeightPlan:
    load_dtype: torch.dtype  # what the checkpoint is read in (fp32 where codes are to be found first)
    keep_codes: bool  # a bf16 model keeps its fp32 checkpoint's integer codes, found before the cast
    cache_codes: bool  # the codes searched for are read from / written to the on-disk cache


def plan_weights(
    device: torch.device, dtype: torch.dtype, model_path: pathlib.Path, world_size: int
) -> WeightPlan:
    """The one decision about a rank's weight formats (with tensor/pipeline parallelism no codes are kept
    for a bf16 model, and nothing is cached: each rank holds a shard)."""
    keep_codes = world_size == 1 and bf16_codes_wanted(device, dtype) and checkpoint_is_float32(model_path)
    load_dtype = torch.float32 if keep_codes else dtype
    searches = device.type == "cpu" and load_dtype == torch.float32 and cpu_linear_mode() == "1"
    return WeightPlan(load_dtype, keep_codes, searches and world_size == 1 and cpu_kernels.available())


def prepare_weights(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, plan: WeightPlan,
    codes_cache: CodesCache | None = None,
) -> None:
    """Pack the loaded model's linears for the kernels that will run them (in place); the fp32 copies a
    packing replaces go back to the OS."""
    if can_prepack(device, dtype) and hasattr(model, "prepack_linears"):
        if plan.keep_codes:
            model.attach_weight_codes(codes_cache)
            model.to(dtype)
            release_freed_memory()
        model.prepack_linears()
    elif fp32_linear_ops(device, dtype) is not None and hasattr(model, "pack_linears_cpu"):
        model.pack_linears_cpu(cache=codes_cache)
        release_freed_memory()


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim). Weights of a few MB can sit in the
    heap rather than in their own mappings (glibc raises its mmap threshold up to 32 MB as mapped blocks
    are freed), and freeing them then leaves the process's RSS as it was."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
