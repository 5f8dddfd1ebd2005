"""Test helper: a Hugging Face folder re-stored in bf16 or fp16, the format nearly every Hub repo ships.

The bundled model is a GGUF (Q4_1 projections, a Q8_0 embedding) converted to an fp32 folder, so every
other test loads fp32 weights that are dequantized integer blocks. cast_checkpoint writes the same
model as the real SmolLM2-135M-Instruct repo stores it: every floating tensor cast to the dtype
(torch's round-to-nearest-even), `model.safetensors` with `{"format": "pt"}` metadata as transformers
writes it, config.json's `torch_dtype` set to the dtype, and every other file (tokenizer, chat
template, generation_config.json) copied unchanged.

Self-contained (torch and safetensors only, nothing from tests/): e2e/ loads it by file path, as it
loads tests/hub_standin.py.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch

HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16"}  # the names in a safetensors header


def cast_checkpoint(src: str | pathlib.Path, dst: str | pathlib.Path, dtype: str) -> pathlib.Path:
    """src (an HF folder of safetensors) written to dst with every floating tensor in `dtype`; returns dst.

    Raises ValueError for an unknown dtype, and for a tensor with values beyond fp16's range (65504),
    naming it: a cast to inf would load without complaint and give wrong answers."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if dtype not in HALF_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, HALF_DTYPES))}; got {dtype!r}")
    target = HALF_DTYPES[dtype]
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors weight files to cast")
    dst.mkdir(parents=True, exist_ok=True)
    limit = torch.finfo(target).max
    for file in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if t.is_floating_point():
                    if t.numel() and t.abs().max().item() > limit:
                        raise ValueError(f"{file.name}: tensor {key!r} has values beyond {dtype}'s range ({limit})")
                    t = t.to(target)
                tensors[key] = t.contiguous()
        save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
        del tensors
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name != "config.json":
            shutil.copy(p, dst / p.name)
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = dtype
    config.pop("dtype", None)  # transformers 5 writes "dtype"; Hub repos carry "torch_dtype", which it reads too
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def safetensors_dtypes(folder: str | pathlib.Path) -> dict[str, str]:
    """tensor name -> its dtype as the files' JSON headers name it (no tensor data read)."""
    import struct

    out: dict[str, str] = {}
    for file in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        out.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return out
