"""Read safetensors tensors one at a time with plain file reads, and write a checkpoint the same way.

No memory map: a mapped file's pages count in the process's RSS (and its cgroup's) as long as the map
lives, so reading a whole checkpoint through one grows RSS by the checkpoint's size on top of the model.
A read() goes through the page cache, which the kernel reclaims first, and lands in a buffer we choose:
the parameter itself when the stored dtype is the served one, else one tensor-sized buffer.
"""

import ctypes
import io
import json
import pathlib
import struct
from collections.abc import Callable

import torch
from tokenmill.engine.load_memory import TensorInfo

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_TAGS = {v: k for k, v in TORCH_DTYPES.items()}


def torch_dtype(info: TensorInfo) -> torch.dtype:
    return TORCH_DTYPES[info.dtype]


def read_into(f: io.BufferedReader, info: TensorInfo, out: torch.Tensor) -> torch.Tensor:
    """Read the tensor's bytes straight into `out` (a contiguous CPU tensor of its dtype and size)."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != torch_dtype(info):
        raise ValueError(f"cannot read {info.name!r} ({info.dtype}) into a {out.dtype} {out.device} tensor")
    if out.numel() * out.element_size() != info.nbytes:
        raise ValueError(f"tensor {info.name!r} has {info.nbytes} bytes, the destination {out.numel() * out.element_size()}")
    if info.nbytes:
        view = memoryview((ctypes.c_char * info.nbytes).from_address(out.data_ptr())).cast("B")
        f.seek(info.offset)
        done = 0
        while done < info.nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"weight file {info.file} ends inside tensor {info.name!r}")
            done += n
    return out


def read_tensor(f: io.BufferedReader, info: TensorInfo) -> torch.Tensor:
    """The tensor in a new buffer of its own (its stored dtype and shape)."""
    return read_into(f, info, torch.empty(info.shape, dtype=torch_dtype(info)))


def write_safetensors(
    path: pathlib.Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], make: Callable[[str], torch.Tensor]
) -> None:
    """Write a safetensors file holding, in order, the tensors `specs` names (dtype, shape), each made by
    make(name) only when its turn comes: one tensor in memory at a time."""
    header, offset = {}, 0
    for name, (dtype, shape) in specs.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _TAGS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, (dtype, shape) in specs.items():
            t = make(name).contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: made {t.dtype} {list(t.shape)}, declared {dtype} {list(shape)}")
            n = t.numel() * t.element_size()
            if n:
                f.write(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))
