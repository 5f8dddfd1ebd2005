"""How a rank's loaded weights become what the CPU kernels read, decided once per rank (WeightPlan) and
carried out once (prepare_weights).

A bf16 CPU model whose checkpoint is all fp32 (a GGUF conversion) has each weight's integer codes found
bit for bit in its fp32 values, then runs its small batches from the codes (cpu_gemm_policy.
bf16_codes_wanted). An fp32 CPU model packs its weights for the fp32 kernel (codes where lossless, fp32
panels otherwise); a bf16 one also prepacks them for oneDNN. The codes found are kept on disk between
starts (model/weight_codes_cache.py) when one rank holds the whole model.

Both the codes search and the fp32 packing run while the weights stream in (loading_hooks: one parameter
at a time, model/loader.py), so no whole fp32 copy of the model is ever held: the load's peak stays
within the final weights + the largest tensor + load_memory.LOAD_MARGIN_BYTES.
"""

import ctypes
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tokenmill.engine.layers.cpu_gemm_policy import (
    bf16_codes_wanted,
    can_prepack,
    cpu_linear_mode,
    fp32_linear_ops,
)
from tokenmill.engine.layers.grouped_codes import GroupedPackedWeight, SplitPackedWeight
from tokenmill.engine.layers.linear import CpuPackedWeight
from tokenmill.engine.layers.weight_codes import CodesCache
from tokenmill.engine.model.loader import checkpoint_is_float32
from tokenmill.kernels import cpu as cpu_kernels


@dataclass(frozen=True, slots=True)
class WeightPlan:
    load_dtype: torch.dtype  # what the model's parameters are made in: the served dtype
    keep_codes: bool  # a bf16 model keeps its fp32 checkpoint's integer codes, found before the cast
    cache_codes: bool  # the codes searched for are read from / written to the on-disk cache


def plan_weights(
    device: torch.device, dtype: torch.dtype, model_path: pathlib.Path, world_size: int
) -> WeightPlan:
    """The one decision about a rank's weight formats (with tensor/pipeline parallelism no codes are kept
    for a bf16 model, and nothing is cached: each rank holds a shard)."""
    keep_codes = world_size == 1 and bf16_codes_wanted(device, dtype) and checkpoint_is_float32(model_path)
    searches = device.type == "cpu" and (keep_codes or dtype == torch.float32) and cpu_linear_mode() == "1"
    return WeightPlan(dtype, keep_codes, searches and world_size == 1 and cpu_kernels.available())


def loading_hooks(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, plan: WeightPlan,
    codes_cache: CodesCache | None = None,
) -> dict[str, Callable[[torch.Tensor], bool]] | None:
    """What prepare_weights would do to a whole fp32 model, as per-parameter hooks for the loader's
    fp32_hooks: the codes search of a bf16 model (plan.keep_codes), the fp32 kernel's packing; None when
    neither applies. A model loaded with them is finished by prepare_weights(..., streamed=True)."""
    if can_prepack(device, dtype) and plan.keep_codes and hasattr(model, "codes_hooks"):
        return _stage_named(model.codes_hooks(codes_cache), codes_cache)
    if fp32_linear_ops(device, dtype) is not None and hasattr(model, "pack_hooks"):
        return model.pack_hooks(cache=codes_cache)
    return None


def _stage_named(
    hooks: dict[str, Callable[[torch.Tensor], bool]], cache: CodesCache | None
) -> dict[str, Callable[[torch.Tensor], bool]]:
    """The on-disk codes cache finds a weight by its parameter's storage (weight_codes_cache.py); a bf16
    model's codes are searched in an fp32 stage of the parameter, so the stage goes by that name too."""
    names = getattr(cache, "names", None)
    if not isinstance(names, dict):
        return hooks

    def named(name: str, hook: Callable[[torch.Tensor], bool]) -> Callable[[torch.Tensor], bool]:
        def run(stage: torch.Tensor) -> bool:
            names[stage.data_ptr()] = name
            try:
                return hook(stage)
            finally:
                names.pop(stage.data_ptr(), None)

        return run

    return {name: named(name, hook) for name, hook in hooks.items()}


def prepare_weights(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, plan: WeightPlan,
    codes_cache: CodesCache | None = None, streamed: bool = False,
) -> None:
    """Pack the loaded model's linears for the kernels that will run them (in place); the fp32 copies a
    packing replaces go back to the OS. streamed: the model was loaded with loading_hooks, which already
    found its codes or packed it for the fp32 kernel. Without them, a keep_codes model is loaded whole in
    fp32 and cast here (twice the served weights at the peak)."""
    if can_prepack(device, dtype) and hasattr(model, "prepack_linears"):
        if plan.keep_codes and not streamed:
            model.attach_weight_codes(codes_cache)
            model.to(dtype)
        release_freed_memory()
        model.prepack_linears()
    elif fp32_linear_ops(device, dtype) is not None and hasattr(model, "pack_linears_cpu"):
        if not streamed:
            model.pack_linears_cpu(cache=codes_cache)
    release_freed_memory()


def use_int8_activations(model: torch.nn.Module) -> int:
    """Turn on int8 activations (EngineConfig.int8_activations) for every weight whose kernel has an int8
    form: integer codes (the projections, the LM head and a tied embedding's packed matrix; fp32 scales for
    fp32 rows, fp32 or fp16 for bf16 rows) and 4-bit grouped codes (Q4_K, AWQ / GPTQ int4), also as parts of
    a split q|k|v; returns how many. Others (fp32, bf16 or dense bf16 panels, Q5_K / Q6_K) stay exact. The
    caller checks that the model's dtype has the kernel (fp32: AVX2; bf16: int8x_bf16_supported)."""
    seen: set[int] = set()

    def turn_on(value: object) -> None:
        if isinstance(value, SplitPackedWeight):
            for part in value.parts:
                turn_on(part)
            return
        codes = isinstance(value, CpuPackedWeight) and value.codes is not None
        if (codes or (isinstance(value, GroupedPackedWeight) and value.int8x_supported)) and id(value) not in seen:
            value.int8_x = True
            seen.add(id(value))

    for module in model.modules():
        for value in vars(module).values():
            turn_on(value)
    return len(seen)


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim). Weights of a few MB can sit in the
    heap rather than in their own mappings (glibc raises its mmap threshold up to 32 MB as mapped blocks
    are freed), and freeing them then leaves the process's RSS as it was."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
