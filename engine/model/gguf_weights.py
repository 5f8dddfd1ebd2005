"""Load a GGUF file's weights straight from its blocks: quantized 2-D weights become the kernels' integer
codes (no fp32 copy on disk or in memory), everything else is read into its parameter.

- GGUF Q4_0, Q4_1, Q8_0 -> cpu_linear.cpp's codes layout (layers/linear.CpuPackedWeight): the very codes,
  scales and mins that searching the dequantized fp32 weights finds (layers/weight_codes.py), so every
  kernel of the bundled model runs as before.
- Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 -> the grouped layout (layers/grouped_codes.GroupedPackedWeight).
- F32, F16, BF16 tensors (norms, small weights) -> their parameter, cast to the served dtype.

Codes are kept where the CPU kernels can run them: a CPU rank holding the whole model (no tensor
parallelism: the codes cannot be split along K mid-block) serving fp32 or bf16. Elsewhere (CUDA, fp16,
tensor parallel, no C++ kernels) each tensor is dequantized with gguf-py into its parameter: the served
dtype's bytes, one tensor's fp32 values at a time, nothing on disk.

One tensor is read at a time with plain file reads (no memory map: mapped pages count in RSS), then
decoded in chunks of rows straight into the final panels (gguf_blocks.py). So the load's peak is the final
weights + the largest tensor as stored + a chunk's temporaries (load_memory.LOAD_MARGIN_BYTES).
"""

import io
import pathlib
from collections.abc import Callable

import numpy as np
import torch
from tokenmill.engine.gguf_header import GGUFTensor, read_gguf_header
from tokenmill.engine.layers.grouped_codes import CodesEmbedding, GroupedPackedWeight, SplitPackedWeight
from tokenmill.engine.layers.linear import CpuPackedWeight, Linear
from tokenmill.engine.model import gguf_blocks, sharding
from tokenmill.engine.model.gguf_cache import WEIGHTS_LINK
from tokenmill.engine.model.gguf_convert import GGUFError, hf_tensor_name, unpermute_qk
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.quant_memory import CODES_GGUF, GROUPED_GGUF, SUPPORTED_GGUF, codes_held

_CHUNK_ROWS = 1024  # rows decoded at a time: a multiple of 16 (panels), a few MB of temporaries


def gguf_weights_file(folder: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file whose weights a model folder loads (its cache folder links to it), or None."""
    link = folder / WEIGHTS_LINK
    return link if link.exists() else None


def _read(f: io.BufferedReader, t: GGUFTensor) -> np.ndarray:
    """The tensor's raw bytes as [rows, row bytes] (one row per weight row)."""
    raw = np.empty(t.nbytes, dtype=np.uint8)
    f.seek(t.offset)
    if f.readinto(memoryview(raw)) != t.nbytes:
        raise GGUFError(f"{f.name}: file ends inside tensor {t.name!r} (truncated?)")
    rows = t.shape[0] if len(t.shape) == 2 else 1
    return raw.reshape(rows, -1)


def _dequantize(f: io.BufferedReader, t: GGUFTensor) -> np.ndarray:
    """float32 values of any tensor gguf-py can dequantize, in its numpy shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _read(f, t)
    if t.type_name == "F32":
        return raw.view(np.float32).reshape(t.shape)
    try:
        w = dequantize(raw.reshape(-1), GGMLQuantizationType[t.type_name])
    except (NotImplementedError, KeyError):
        raise GGUFError(f"{f.name}: tensor {t.name} uses quantization {t.type_name}, which cannot be loaded") from None
    return np.asarray(w, dtype=np.float32).reshape(t.shape)


class PanelBuilder:
    """The panel arrays of one parameter, filled chunk by chunk of rows from one or more GGUF tensors."""

    def __init__(self, rows: int) -> None:
        self.p = -(-rows // 16)
        self.arrays: dict[str, np.ndarray] = {}

    def _dest(self, name: str, like: np.ndarray) -> np.ndarray:
        if name not in self.arrays:
            self.arrays[name] = np.zeros((self.p, *like.shape[1:]), dtype=like.dtype)
        dest = self.arrays[name]
        if dest.dtype != like.dtype:  # an fp16 scale array meeting a value fp16 cannot hold: widen it
            dest = self.arrays[name] = dest.astype(np.result_type(dest.dtype, like.dtype))
        return dest

    def put(self, first: int, panels: dict[str, np.ndarray]) -> None:
        """Panels of rows first.. (first a multiple of 16)."""
        p0 = first // 16
        for name, a in panels.items():
            dest = self._dest(name, a)
            n = min(a.shape[0], self.p - p0)
            dest[p0 : p0 + n] = a[:n]


def _codes_panels(type_name: str, raw: np.ndarray, half: bool) -> dict[str, np.ndarray]:
    q, s, m = gguf_blocks.decode_codes(type_name, raw)
    codes = gguf_blocks.nibble_panels(q) if CODES_GGUF[type_name] == 4 else gguf_blocks.to_panels(q)
    scales, mins = gguf_blocks.to_panels(s), gguf_blocks.to_panels(m)
    if half:
        s16, m16 = scales.astype(np.float16), mins.astype(np.float16)
        if np.array_equal(s16.astype(np.float32), scales) and np.array_equal(m16.astype(np.float32), mins):
            scales, mins = s16, m16
    return {"codes": codes, "scales": scales, "mins": mins}


def _grouped_panels(type_name: str, raw: np.ndarray) -> dict[str, np.ndarray]:
    fmt = GROUPED_GGUF[type_name]
    q, sc, mn, d, dmin = gguf_blocks.decode_grouped(type_name, raw)
    out = {
        "lo": gguf_blocks.nibble_panels(q),
        "hi": gguf_blocks.bit_planes(q, fmt.bits - 4),
        "sc": gguf_blocks.to_panels(sc),
        "d": gguf_blocks.to_panels(d),
    }
    if fmt.has_min:
        out["mn"], out["dmin"] = gguf_blocks.to_panels(mn), gguf_blocks.to_panels(dmin)
    return out


def layout_of(type_name: str) -> str | None:
    """"codes", "grouped", or None (a float tensor, loaded into its parameter)."""
    if type_name in CODES_GGUF:
        return "codes"
    if type_name in GROUPED_GGUF:
        return "grouped"
    return None


def packed_weight(
    f: io.BufferedReader, parts: list[tuple[GGUFTensor, int]], rows: int, permute: dict[str, int],
    half_scales: bool, embed_dtype: torch.dtype,
) -> CpuPackedWeight | GroupedPackedWeight:
    """One parameter [rows, K] from GGUF tensors of one type (each (tensor, first row)), in its layout.
    permute: tensor name -> heads, for llama.cpp's permuted Q/K rows."""
    type_name = parts[0][0].type_name
    layout = layout_of(type_name)
    b = PanelBuilder(rows)
    for t, first in parts:
        raw = _read(f, t)
        if t.name in permute:
            raw = unpermute_qk(raw, permute[t.name])
        for r in range(0, raw.shape[0], _CHUNK_ROWS):
            chunk = raw[r : r + _CHUNK_ROWS]
            panels = _codes_panels(type_name, chunk, half_scales) if layout == "codes" else _grouped_panels(type_name, chunk)
            b.put(first + r, panels)
        del raw
    a = {name: torch.from_numpy(v) for name, v in b.arrays.items()}
    if layout == "codes":
        return CpuPackedWeight(rows, codes=a["codes"], scales=a["scales"], mins=a["mins"])
    fmt = GROUPED_GGUF[type_name]
    empty8, empty16 = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.float16)
    return GroupedPackedWeight(
        rows, fmt, a["lo"], a["hi"].view(torch.int32), a["sc"], a.get("mn", empty8), a["d"], a.get("dmin", empty16),
        embed_dtype=embed_dtype,
    )


def codes_supported(device: torch.device, dtype: torch.dtype, tp_size: int) -> bool:
    """Whether quantized GGUF weights are kept as codes (module docstring), else dequantized at load."""
    from tokenmill.engine.layers.cpu_gemm_policy import bf16_dot_supported, cpu_linear_mode
    from tokenmill.kernels import cpu as cpu_kernels

    dtype_name = str(dtype).removeprefix("torch.")
    if not codes_held(device.type, dtype_name, tp_size, True) or cpu_linear_mode() != "1":
        return False
    ops = cpu_kernels.load()
    if ops is None or not ops.packed_linear_supported():
        return False
    return dtype == torch.float32 or bf16_dot_supported()


def _module(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def _attach(model: torch.nn.Module, name: str, packed: object, dtype: torch.dtype) -> None:
    """Make `packed` stand for parameter `name` (its storage is dropped)."""
    if name == "model.embed_tokens.weight":
        embed = model.model.embed_tokens
        embed.packed_cpu = packed if isinstance(packed, GroupedPackedWeight) else CodesEmbedding(packed, dtype)
        embed.weight = None
        if model.config.tie_word_embeddings and model.par.is_last_stage:
            model.lm_head_packed_cpu = packed
        return
    module = _module(model, name)
    if not isinstance(module, Linear):
        raise GGUFError(f"quantized tensor for {name}, which is not a linear layer")
    module.packed_cpu = packed
    module.weight = None
    if name == "lm_head.weight":
        model.lm_head_packed_cpu = packed


def load_gguf_weights(
    model: torch.nn.Module,
    config: ModelConfig,
    path: pathlib.Path,
    par: object,
    codes: bool,
    hooks: dict[str, Callable[[torch.Tensor], bool]] | None = None,
) -> None:
    """Fill `model` (built with materialize: empty parameters) from GGUF file `path`; with `codes`, its
    quantized weights as packed codes (module docstring). hooks: load_weights' fp32_hooks, run for the
    parameters filled as tensors."""
    from tokenmill.engine.layers.cpu_gemm_policy import bf16_dot_supported

    path = pathlib.Path(path)
    try:
        header = read_gguf_header(path)
    except ValueError as e:
        raise GGUFError(str(e)) from None
    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype
    targets = sharding.weight_targets(config, par)
    permuted = header.get("general.architecture") == "llama"  # llama.cpp permutes Q/K rows for it only
    permute: dict[str, int] = {}
    sources: dict[str, list[tuple[GGUFTensor, int, int | None, str]]] = {}
    for t in header.tensors:
        if t.type_name not in SUPPORTED_GGUF:
            raise GGUFError(
                f"{path}: tensor {t.name} uses quantization {t.type_name}; supported: {', '.join(sorted(SUPPORTED_GGUF))}"
            )
        key = hf_tensor_name(path, t.name)
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if permuted and key.endswith(("q_proj.weight", "k_proj.weight")):
            permute[t.name] = config.num_attention_heads if key.endswith("q_proj.weight") else config.num_key_value_heads
        target = sharding.local_target(key, config, par, targets)
        if target is None:
            continue
        name, first, rows = target
        if name not in params:
            raise GGUFError(f"{path}: unexpected tensor {t.name!r} for {config.architecture}")
        sources.setdefault(name, []).append((t, first, rows, key))
    missing = sorted(set(params) - set(sources))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise GGUFError(f"{path} is missing weights for: {shown}")
    half = dtype == torch.bfloat16 and bf16_dot_supported()
    hooks = hooks or {}
    with open(path, "rb") as f:
        for name, param in params.items():
            srcs = sources[name]
            if codes and param.dim() == 2 and all(layout_of(t.type_name) for t, *_ in srcs):
                srcs = sorted(srcs, key=lambda s: s[1])
                if len({t.type_name for t, *_ in srcs}) == 1 and all(first % 16 == 0 for _, first, _, _ in srcs):
                    parts = [(t, first) for t, first, _, _ in srcs]
                    packed = packed_weight(f, parts, param.shape[0], permute, half, dtype)
                else:  # parts of other types, or not on a panel boundary: one packed weight each
                    packed = SplitPackedWeight(
                        [packed_weight(f, [(t, 0)], t.shape[0], permute, half, dtype) for t, *_ in srcs]
                    )
                _attach(model, name, packed, dtype)
                continue
            _fill_dequantized(f, param, srcs, permute, config, par)
            hook = hooks.get(name)
            if hook is not None and hook(param.data):
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            if name.endswith(".bias") and codes:
                module = _module(model, name)
                if isinstance(module, Linear):  # the codes kernels add an fp32 bias
                    module.bias_fp32 = torch.empty(param.shape, dtype=torch.float32)
                    _fill_dequantized(f, module.bias_fp32, srcs, permute, config, par)


def _fill_dequantized(
    f: io.BufferedReader, dest: torch.Tensor, srcs: list, permute: dict[str, int], config: ModelConfig, par: object
) -> None:
    for t, first, rows, key in srcs:
        w = _dequantize(f, t)
        if t.name in permute:
            w = unpermute_qk(w, permute[t.name])
        tensor = sharding.shard_tensor(key, torch.from_numpy(np.ascontiguousarray(w)), config, par)
        part = dest.data if rows is None else dest.data[first : first + rows]
        if tuple(tensor.shape) != tuple(part.shape):
            raise GGUFError(f"{f.name}: tensor {t.name!r} has shape {list(tensor.shape)}, the model expects {list(part.shape)}")
        part.copy_(tensor)
