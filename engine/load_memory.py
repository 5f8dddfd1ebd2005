"""Host memory while a model's weights load: the bound the streaming loader keeps (model/loader.py) and
the pod memory the operator requests for it (operator/plan/sizing.py), from one margin.

The loader reads a safetensors checkpoint one tensor at a time into the model's own parameters: a tensor
stored in the served dtype is read straight into its parameter, any other is read into one buffer of its
own size and cast from there, and that buffer goes before the next tensor is read. So the load's peak
resident memory is at most the final weights, plus the largest tensor as stored, plus LOAD_MARGIN_BYTES.

Dependency-free on purpose (no torch): the operator imports it, and the safetensors header is read here
with json and struct only.
"""

import json
import pathlib
import struct
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30
# What a load holds besides the weights and one tensor's buffer: the glibc heap's slack (freed blocks it
# keeps below its trim threshold), Python objects and page tables, and the transients of a codes search
# (find_weight_codes' outputs for one weight, 1.25 bytes per weight: the integer codes and their scales).
# Measured with `python -m tokenmill.engine.bench.load_peak` (docs/engine.md, "Loading"): the 297M-parameter
# random Llama peaked at most 16 MB above final weights + largest tensor (its fp32 file served in bf16); 64
# MiB keeps room for allocator behaviour that differs by machine without hiding a second copy of a real model.
LOAD_MARGIN_BYTES = 64 * MIB
# A rank process's own resident memory before any weight: the interpreter, torch and its libraries, the
# CUDA runtime's host side and the engine's Python state. An allowance: torch + a CUDA context + cuBLAS +
# SDPA measured 879 MB peak RSS on an H200 node; the engine's own state there was not (docs/operator.md).
ENGINE_PROCESS_BYTES = 3 * GIB
# The API server process of a pod (tokenizer, HTTP stack), beside the rank processes.
API_SERVER_BYTES = 1 * GIB

# safetensors dtype tags -> bytes per element (the format's full list).
SAFETENSORS_DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100 * MIB  # the safetensors reference implementation's limit


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in the file)."""

    file: pathlib.Path
    name: str
    dtype: str  # the safetensors tag: "F32", "BF16", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(file: pathlib.Path) -> list[TensorInfo]:
    """The tensors of one safetensors file, from its JSON header; every entry is checked against the
    format (known dtype, size = shape x element size, inside the file's data), so that a damaged file is
    refused by name before any weight is read."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"weight file {file} is damaged or not a safetensors file: {size} bytes, no header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"weight file {file} is damaged or not a safetensors file: header length {header_len} "
                f"exceeds the file ({size} bytes) or the {MAX_HEADER_BYTES >> 20} MiB limit"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"weight file {file} is damaged or not a safetensors file: header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"weight file {file} is damaged or not a safetensors file: header is not an object")
    data_start = 8 + header_len
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            elements = 1
            for dim in shape:
                elements *= int(dim)
            expected = elements * SAFETENSORS_DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"weight file {file} is damaged or not a safetensors file: entry {name!r}: {entry!r}") from None
        if end - begin != expected or begin < 0 or data_start + end > size:
            raise ValueError(
                f"weight file {file} is damaged or not a safetensors file: tensor {name!r} ({dtype} {list(shape)}) "
                f"spans bytes {begin}..{end} of {size - data_start}, it needs {expected}"
            )
        out.append(TensorInfo(file, name, dtype, shape, data_start + begin, expected))
    return out


def checkpoint_tensors(folder: pathlib.Path) -> list[TensorInfo]:
    """Every tensor of the folder's *.safetensors files (headers only)."""
    return [t for file in sorted(pathlib.Path(folder).glob("*.safetensors")) for t in read_header(file)]


# Bytes per element the operator assumes for a checkpoint it has not read: float32, the widest a
# checkpoint stores its weights in (a bf16 one needs half).
CHECKPOINT_ELEMENT_BYTES = 4


def largest_tensor_elements(
    vocab_size: int, hidden_size: int, intermediate_size: int, num_attention_heads: int, head_dim: int
) -> int:
    """The largest tensor a Llama-family checkpoint stores, from its shape: the embedding (or LM head),
    an MLP projection or the query projection, whichever is largest."""
    return max(vocab_size * hidden_size, intermediate_size * hidden_size, num_attention_heads * head_dim * hidden_size)


def load_peak_bound_bytes(final_weights_bytes: int, largest_tensor_bytes: int) -> int:
    """The most resident memory a load may add: its final weights, one tensor's read buffer, the margin."""
    return final_weights_bytes + largest_tensor_bytes + LOAD_MARGIN_BYTES


def gpu_rank_load_host_bytes(largest_tensor_bytes: int) -> int:
    """A GPU rank's host memory at its load's peak: the process itself, one tensor read on the host
    before it is copied to the device (the weights themselves live on the GPU), and the margin."""
    return ENGINE_PROCESS_BYTES + largest_tensor_bytes + LOAD_MARGIN_BYTES


def gpu_pod_host_bytes(ranks_per_pod: int, largest_tensor_bytes: int) -> int:
    """A GPU pod's host memory: each of its rank processes loads at once, beside the API server."""
    return API_SERVER_BYTES + ranks_per_pod * gpu_rank_load_host_bytes(largest_tensor_bytes)
