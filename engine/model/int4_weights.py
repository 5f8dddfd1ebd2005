"""AWQ and GPTQ int4 safetensors checkpoints (config.json's quantization_config) loaded as their tensors
hold them: each quantized linear becomes a grouped-layout weight (layers/grouped_codes.py), w = s * (q - z)
per group of input columns, without a dequantized copy. The rest of the checkpoint (embedding, LM head,
norms, biases) loads through loader.load_weights as any tensor does.

Formats, as their quantizers write them (AutoAWQ's WQLinear_GEMM, AutoGPTQ / GPTQModel's QuantLinear):
- AWQ ("quant_method": "awq", "version": "gemm"): qweight int32 [in, out / 8], eight 4-bit codes of eight
  output columns per word in the order 0, 2, 4, 6, 1, 3, 5, 7; qzeros int32 [in / group, out / 8] the same
  way; scales fp16 [in / group, out]. w = (q - z) * s.
- GPTQ ("quant_method": "gptq"): qweight int32 [in / 8, out], eight input rows per word in order; qzeros
  int32 [in / group, out / 8], columns in order; scales fp16 [in / group, out]; g_idx [in]. The
  "gptq" checkpoint format (AutoGPTQ's) stores each zero minus one, "gptq_v2" the zero itself.
  Act-order checkpoints (desc_act, a g_idx other than i / group) are refused.
In float32, s * q - s * z is exact (an fp16 times a 4-bit integer), so the codes rebuild the very values
w = s * (q - z) that dequantizing the checkpoint gives.
"""

import io
import json
import pathlib

import numpy as np
import torch
from tokenmill.engine import quant_memory
from tokenmill.engine.load_memory import TensorInfo, read_header
from tokenmill.engine.model import gguf_blocks, sharding
from tokenmill.engine.model.safetensors_stream import read_tensor
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.quant_memory import Int4Config, int4_group_format

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def int4_config(path: pathlib.Path) -> Int4Config | None:
    """The folder's AWQ / GPTQ int4 configuration, None for an unquantized checkpoint; ValueError for a
    quantization this loader cannot serve (quant_memory.int4_config: the check `serve --check` and the
    operator make too)."""
    return quant_memory.int4_config(json.loads((path / "config.json").read_text()), str(path))


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., n] -> uint8 [..., 8 n]: nibble i of word j at 8 j + i."""
    w = words.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))
    return (w & 15).astype(np.uint8).reshape(*words.shape[:-1], -1)


def unpack(cfg: Int4Config, qweight: np.ndarray, qzeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes [out, in], zeros [out, groups]) as uint8."""
    if cfg.method == "awq":
        order = np.argsort(AWQ_ORDER)  # column c of each eight sits in nibble order[c]
        q = _nibbles(qweight).reshape(qweight.shape[0], -1, 8)[..., order].reshape(qweight.shape[0], -1).T
        z = _nibbles(qzeros).reshape(qzeros.shape[0], -1, 8)[..., order].reshape(qzeros.shape[0], -1).T
    else:
        q = _nibbles(qweight.T)  # [out, in]: words run down the input rows
        z = _nibbles(qzeros).T
        if cfg.zero_plus_one:
            z = (z.astype(np.int16) + 1).astype(np.uint8)  # 15 + 1: a zero of 16 (AutoGPTQ's overflow, kept)
    return np.ascontiguousarray(q), np.ascontiguousarray(z)


def _int4_panels(cfg: Int4Config, q: np.ndarray, z: np.ndarray, s: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of codes, zeros, scales -> grouped-layout panels: sc = 1, mn = z per 32 columns, d = dmin = s."""
    group = q.shape[1] // z.shape[1]
    mn = np.repeat(z, group // 32, axis=1).astype(np.int8)
    return {
        "lo": gguf_blocks.nibble_panels(q),
        "hi": np.zeros((-(-q.shape[0] // 16), q.shape[1] // 2, 0), dtype=np.uint32),
        "sc": gguf_blocks.to_panels(np.ones(mn.shape, dtype=np.int8)),
        "mn": gguf_blocks.to_panels(mn),
        "d": gguf_blocks.to_panels(s),
        "dmin": gguf_blocks.to_panels(s),
    }


def quantized_modules(tensors: list[TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """HF module name -> {"qweight": .., "qzeros": .., "scales": .., "g_idx": ..} of its tensors."""
    out: dict[str, dict[str, TensorInfo]] = {}
    for t in tensors:
        if t.name.endswith(QUANT_SUFFIXES):
            module, part = t.name.rsplit(".", 1)
            out.setdefault(module, {})[part] = t
    return out


def load_int4_linears(
    model: torch.nn.Module, config: ModelConfig, path: pathlib.Path, cfg: Int4Config, par: object, codes: bool
) -> set[str]:
    """Build every quantized linear's grouped weight (fused q/k/v and gate/up in their parameter's row
    order) and attach it, or without `codes` dequantize it into its parameter at once (one weight's
    codes on the host at a time); returns the checkpoint tensor names consumed and the parameters filled."""
    from tokenmill.engine.layers.grouped_codes import GroupedPackedWeight
    from tokenmill.engine.layers.linear import Linear
    from tokenmill.engine.model.gguf_weights import PanelBuilder

    tensors = [t for f in sorted(path.glob("*.safetensors")) for t in read_header(f)]
    modules = quantized_modules(tensors)
    targets = sharding.weight_targets(config, par)
    params = dict(model.named_parameters())
    # Our parameter -> [(first row, HF module)]
    sources: dict[str, list[tuple[int, str]]] = {}
    for module in modules:
        target = sharding.local_target(f"{module}.weight", config, par, targets)
        if target is None:
            continue
        name, first, _ = target
        if name not in params:
            raise ValueError(f"{path}: quantized tensors for {module!r}, which is not a linear layer of {config.architecture}")
        sources.setdefault(name, []).append((first, module))
    files: dict[pathlib.Path, io.BufferedReader] = {}
    consumed: set[str] = set()
    try:
        for name, srcs in sources.items():
            param = params[name]
            builder = PanelBuilder(param.shape[0])
            group = 0
            for first, module in sorted(srcs):
                parts = modules[module]
                missing = {"qweight", "qzeros", "scales"} - set(parts)
                if missing:
                    raise ValueError(f"{path}: {module} lacks {', '.join(sorted(missing))}")
                raw = {}
                for key, info in parts.items():
                    f = files.get(info.file) or files.setdefault(info.file, open(info.file, "rb"))
                    raw[key] = read_tensor(f, info).numpy()
                    consumed.add(info.name)
                q, z = unpack(cfg, raw["qweight"], raw["qzeros"])
                s = raw["scales"].T.astype(np.float16)
                k = q.shape[1]
                group = k // s.shape[1]
                if k % group or group % 32 or (cfg.group_size != -1 and group != cfg.group_size):
                    raise ValueError(f"{path}: {module} has {s.shape[1]} scale groups for {k} inputs (group_size {cfg.group_size})")
                if "g_idx" in raw and not np.array_equal(raw["g_idx"], np.arange(k) // group):
                    raise ValueError(f"{path}: {module} is quantized with act-order (desc_act: g_idx is not i / group_size); "
                                     "not supported: quantize without desc_act")  # fmt: skip
                if first % 16:
                    raise ValueError(f"{path}: {module} starts at row {first} of {name}, not a multiple of 16")
                builder.put(first, _int4_panels(cfg, q, z, s))
            a = {key: torch.from_numpy(v) for key, v in builder.arrays.items()}
            packed = GroupedPackedWeight(
                param.shape[0], int4_group_format(group), a["lo"], a["hi"].view(torch.int32), a["sc"], a["mn"],
                a["d"], a["dmin"], embed_dtype=param.dtype,
            )
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if not isinstance(module, Linear):
                raise ValueError(f"{path}: quantized tensors for {name}, which is not a linear layer")
            if codes:
                module.packed_cpu, module.weight = packed, None
            else:  # another device, fp16, no C++ kernels: the weights in the served dtype
                param.data.copy_(packed.dequantize(param.dtype))
                consumed.add(name)
    finally:
        for f in files.values():
            f.close()
    return consumed
