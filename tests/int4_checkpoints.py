"""Tiny AWQ and GPTQ int4 checkpoints for tests, written the way AutoAWQ (WQLinear_GEMM) and AutoGPTQ /
GPTQModel (QuantLinear) pack them, from a tiny fp32 Hugging Face folder: every projection quantized
round-to-nearest with a zero point per group of input columns, everything else kept. Beside it the same
weights dequantized (w = s * (q - z), exact in fp32) as an ordinary fp32 folder: the parity reference.

The packing follows the formats' published order (AutoAWQ's AWQ_ORDER 0, 2, 4, 6, 1, 3, 5, 7 within each
word of eight output columns; GPTQ eight input rows per word in order, zeros stored minus one in its
"gptq" format); tests/test_int4_checkpoints.py also checks one word of each against a hand-written answer.
"""

import json
import pathlib
import shutil

import numpy as np
import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_rtn(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] -> (q [out, in], z [out, in / group], s fp16 [out, in / group]), 4 bits asymmetric."""
    out, k = w.shape
    g = w.reshape(out, k // group, group)
    lo, hi = np.minimum(g.min(axis=2), 0), np.maximum(g.max(axis=2), 0)
    s = ((hi - lo) / 15).astype(np.float16)
    s = np.where(s == 0, np.float16(1e-3), s)
    z = np.clip(np.rint(-lo / s.astype(np.float32)), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(g / s.astype(np.float32)[..., None] + z[..., None]), 0, 15).astype(np.uint8)
    return q.reshape(out, k), z, s


def dequantized(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> np.ndarray:
    group = q.shape[1] // z.shape[1]
    sf = np.repeat(s.astype(np.float32), group, axis=1)
    return sf * q.astype(np.float32) - sf * np.repeat(z, group, axis=1).astype(np.float32)


def _pack(nibbles: np.ndarray) -> np.ndarray:
    """uint8 [..., 8 n] -> int32 [..., n]: value 8 j + i in nibble i of word j."""
    v = nibbles.astype(np.uint32).reshape(*nibbles.shape[:-1], -1, 8) << (4 * np.arange(8, dtype=np.uint32))
    return np.bitwise_or.reduce(v, axis=-1).view(np.int32)


def pack_awq(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> dict[str, np.ndarray]:
    """AWQ GEMM tensors: qweight [in, out / 8], qzeros [in / group, out / 8], scales [in / group, out]."""
    def cols(a: np.ndarray) -> np.ndarray:  # [rows, out]: nibble i of each word holds column AWQ_ORDER[i]
        return _pack(a.reshape(a.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(a.shape[0], -1))

    return {"qweight": cols(q.T), "qzeros": cols(z.T), "scales": np.ascontiguousarray(s.T)}


def pack_gptq(q: np.ndarray, z: np.ndarray, s: np.ndarray, v2: bool = False) -> dict[str, np.ndarray]:
    """GPTQ tensors: qweight [in / 8, out], qzeros [in / group, out / 8] (minus one unless v2), scales
    [in / group, out], g_idx [in]."""
    group = q.shape[1] // z.shape[1]
    stored = z if v2 else (z.astype(np.int16) - 1).astype(np.uint8) & 15
    return {
        "qweight": np.ascontiguousarray(_pack(q).T),  # q [out, in]: words along the input rows
        "qzeros": _pack(np.ascontiguousarray(stored.T)),
        "scales": np.ascontiguousarray(s.T),
        "g_idx": (np.arange(q.shape[1]) // group).astype(np.int32),
    }


def write_int4(src: pathlib.Path, dst: pathlib.Path, ref: pathlib.Path, method: str, group: int = 128,
               v2: bool = False) -> None:  # fmt: skip
    """The int4 checkpoint of HF folder src into dst, and its dequantized fp32 twin into ref."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    quant, deq = {}, {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            q, z, s = quantize_rtn(t.numpy(), group)
            packed = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, v2)
            quant.update({f"{module}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()})
            deq[name] = torch.from_numpy(dequantized(q, z, s))
        else:
            quant[name] = deq[name] = t
    for folder, weights in ((dst, quant), (ref, deq)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"}  # fmt: skip
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                      "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
