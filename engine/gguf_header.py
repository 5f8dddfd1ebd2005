"""The header of a GGUF file (llama.cpp's format): its metadata and tensor table, read with struct alone.

Dependency-free on purpose (no torch, no numpy, no gguf package): the operator reads a GGUF's header to
size the model by the bytes its tensors really take (engine/quant_memory.py), and the engine's loader
finds each tensor's blocks from the same table. Only the header is read; tensor data stays on disk.

Layout (llama.cpp's gguf.h, versions 2 and 3): "GGUF", version u32, tensor count u64, metadata count
u64; each metadata entry a string key, a u32 type and its value; each tensor a string name, u32 dims,
u64 sizes (fastest first), u32 ggml type, u64 offset into the data, which starts at the next multiple
of general.alignment (32 by default) after the table. Strings are a u64 length and UTF-8 bytes.
"""

import pathlib
import struct
from collections.abc import Callable
from dataclasses import dataclass

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# A header larger than this is damage, not a model (a 128k-token vocabulary with its merges is ~10 MB).
MAX_HEADER_BYTES = 256 << 20

# ggml type id -> (name, weights per block, bytes per block): ggml's type traits (ggml.c), the values
# gguf-py's GGML_QUANT_SIZES holds (tests/test_gguf_header.py compares them).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}  # fmt: skip

# Metadata value types: id -> struct format of one scalar (8 = string, 9 = array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """A file whose header is not a GGUF this reader understands; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy / torch order: [rows, columns] for a weight (GGUF lists columns first)
    type_name: str  # "Q4_K", "F32", ...
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    metadata: dict[str, object]  # arrays longer than keep_arrays are replaced by their length (an int)
    tensors: list[GGUFTensor]
    data_offset: int  # where tensor data starts

    def get(self, key: str, default: object = None) -> object:
        return self.metadata.get(key, default)


class _Reader:
    """Reads from read(n) (a file's, or an HTTP range reader's), counting what it consumed."""

    def __init__(self, read: Callable[[int], bytes], where: str) -> None:
        self.read_fn, self.where, self.pos = read, where, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > MAX_HEADER_BYTES:
            raise GGUFHeaderError(f"{self.where}: GGUF header runs past {MAX_HEADER_BYTES >> 20} MiB (damaged?)")
        raw = self.read_fn(n)
        if len(raw) != n:
            raise GGUFHeaderError(f"{self.where}: file ends inside the GGUF header (at byte {self.pos + len(raw)})")
        self.pos += n
        return raw

    def scalar(self, fmt: str) -> object:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"{self.where}: a GGUF string at byte {self.pos - n} is not UTF-8") from None

    def value(self, kind: int, keep_arrays: int) -> object:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _ARRAY or (item not in _SCALARS and item != _STRING):
                raise GGUFHeaderError(f"{self.where}: unsupported GGUF array item type {item}")
            if item in _SCALARS and count > keep_arrays:  # skip in one read: a vocabulary's scores
                self.take(count * struct.calcsize(_SCALARS[item]))
                return count
            values = [self.value(item, keep_arrays) for _ in range(count)]
            return values if count <= keep_arrays else count
        raise GGUFHeaderError(f"{self.where}: unknown GGUF metadata type {kind}")


def parse_gguf_header(read: Callable[[int], bytes], where: str, keep_arrays: int = 1 << 62) -> GGUFHeader:
    """The header from a stream positioned at the file's start. keep_arrays: arrays with more items are
    kept as their length only (the operator needs no vocabulary)."""
    r = _Reader(read, where)
    if r.take(4) != MAGIC:
        raise GGUFHeaderError(f"{where} is not a GGUF file (no GGUF magic)")
    version = r.scalar("<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"{where}: GGUF version {version} is not supported; supported: 2, 3")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.scalar("<I"), keep_arrays)
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        kind, offset = r.scalar("<I"), r.scalar("<Q")
        raw.append((name, tuple(reversed(dims)), kind, offset))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise GGUFHeaderError(f"{where}: general.alignment {align!r} is not a positive integer")
    data_offset = -(-r.pos // align) * align
    tensors = []
    for name, shape, kind, offset in raw:
        if kind not in GGML_TYPES:
            raise GGUFHeaderError(f"{where}: tensor {name!r} has unknown ggml type {kind}")
        type_name, block, block_bytes = GGML_TYPES[kind]
        elements = 1
        for d in shape:
            elements *= d
        if shape and shape[-1] % block:
            raise GGUFHeaderError(f"{where}: tensor {name!r} ({type_name}) has rows of {shape[-1]}, not whole blocks of {block}")
        tensors.append(GGUFTensor(name, shape, type_name, data_offset + offset, elements // block * block_bytes))
    return GGUFHeader(version, metadata, tensors, data_offset)


def read_gguf_header(path: str | pathlib.Path, keep_arrays: int = 1 << 62) -> GGUFHeader:
    """The header of a local GGUF file; every tensor is checked to lie inside the file."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = parse_gguf_header(f.read, str(path), keep_arrays)
    for t in header.tensors:
        if t.offset + t.nbytes > size:
            raise GGUFHeaderError(
                f"{path}: tensor {t.name!r} spans bytes {t.offset}..{t.offset + t.nbytes}, the file has {size} "
                "(truncated?)"
            )
    return header
