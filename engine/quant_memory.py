"""Bytes a quantized model's weights take once loaded, by format: the one count the engine's plan and the
operator's sizing both use.

Dependency-free on purpose (no torch): the operator imports it. A quantized weight is held as the kernels
read it (engine/layers/weight_codes.py, engine/layers/grouped_codes.py), in panels of 16 output rows
(the last one padded):

- "codes" (GGUF Q4_0, Q4_1, Q8_0): one code per weight, two to a byte for 4-bit formats, and per 32
  weights a scale and a min, fp16 where the model computes in half precision, fp32 otherwise.
- "grouped" (GGUF Q4_K, Q5_K, Q6_K, Q5_0, Q5_1; AWQ and GPTQ int4): 4 bits of each code two to a byte
  plus one bit plane per further bit; per sub-block (32 weights, 16 for Q6_K) an int8 scale and, where the
  format has one, an int8 min; per super-block (256 weights, or the AWQ/GPTQ group) an fp16 scale and
  fp16 min scale. Q4_K: 0.578 bytes per weight against the file's 0.5625.

Unquantized tensors (norms, an F16 or F32 weight) are held in the served dtype.
"""

from dataclasses import dataclass

from tokenmill.engine import kv_memory

PANEL = 16  # output rows per panel (kernels/csrc: every weight layout)


@dataclass(frozen=True, slots=True)
class GroupedFormat:
    """How a format maps onto the grouped layout: w = (d * sc) * (q - offset) - dmin * mn."""

    bits: int  # code bits: 4, 5 or 6
    block: int  # weights per sub-block scale sc (and min mn)
    group: int  # weights per super-block scale d (and dmin)
    offset: int  # subtracted from every code (Q6_K: 32; Q5_0: 16)
    has_min: bool  # mn and dmin present


# GGUF types loaded into the grouped layout; Q4_0, Q4_1 and Q8_0 go to the "codes" layout.
GROUPED_GGUF: dict[str, GroupedFormat] = {
    "Q4_K": GroupedFormat(4, 32, 256, 0, True),
    "Q5_K": GroupedFormat(5, 32, 256, 0, True),
    "Q6_K": GroupedFormat(6, 16, 256, 32, False),
    "Q5_0": GroupedFormat(5, 32, 32, 16, False),
    "Q5_1": GroupedFormat(5, 32, 32, 0, True),
}
CODES_GGUF = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # type -> code bits
FLOAT_GGUF = {"F32", "F16", "BF16"}
SUPPORTED_GGUF = set(GROUPED_GGUF) | set(CODES_GGUF) | FLOAT_GGUF


def int4_group_format(group_size: int) -> GroupedFormat:
    """AWQ / GPTQ int4 with zero points: w = s * (q - z) per group, as sc = 1, mn = z, d = dmin = s."""
    return GroupedFormat(4, 32, group_size, 0, True)


def _panel_rows(rows: int) -> int:
    return -(-rows // PANEL) * PANEL


def grouped_bytes(fmt: GroupedFormat, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight in the grouped layout."""
    n = _panel_rows(rows)
    codes = n * cols // 2 + n * cols * (fmt.bits - 4) // 8  # nibbles + one bit per weight per further plane
    sub = n * (cols // fmt.block) * (2 if fmt.has_min else 1)  # int8 sc (and mn)
    sup = n * (cols // fmt.group) * 2 * (2 if fmt.has_min else 1)  # fp16 d (and dmin)
    return codes + sub + sup


def codes_bytes(bits: int, rows: int, cols: int, half_scales: bool) -> int:
    """Bytes of a [rows, cols] weight in the codes layout (GGUF Q4_0 / Q4_1 / Q8_0)."""
    n = _panel_rows(rows)
    return n * cols * bits // 8 + 2 * n * (cols // 32) * (2 if half_scales else 4)


def tensor_bytes(type_name: str, shape: tuple[int, ...], dtype: str, half_scales: bool) -> int:
    """Bytes one GGUF tensor takes once loaded for a model served in `dtype`."""
    elements = 1
    for d in shape:
        elements *= d
    if len(shape) == 2 and type_name in GROUPED_GGUF:
        return grouped_bytes(GROUPED_GGUF[type_name], *shape)
    if len(shape) == 2 and type_name in CODES_GGUF:
        return codes_bytes(CODES_GGUF[type_name], *shape, half_scales)
    if type_name not in SUPPORTED_GGUF:
        raise ValueError(f"GGUF tensor type {type_name} is not supported; supported: {', '.join(sorted(SUPPORTED_GGUF))}")
    return elements * kv_memory.dtype_bytes(dtype)


def half_scales(dtype: str) -> bool:
    """Whether codes-layout scales are kept in fp16 for a model served in `dtype` (where the half-precision
    kernels read them; the fp32 kernels read fp32)."""
    return dtype != "float32"


@dataclass(frozen=True, slots=True)
class QuantizedWeights:
    """What a quantized checkpoint holds and what it takes once loaded."""

    format: str  # "gguf" | "awq" | "gptq"
    file_bytes: int  # the weights as stored
    loaded_bytes: int  # as held (served dtype)
    largest_tensor_bytes: int  # the largest tensor as stored: the loader reads one at a time
    parameters: int
    types: dict[str, int]  # quantization type -> parameters stored in it

    @property
    def bytes_per_weight(self) -> float:
        return self.loaded_bytes / max(1, self.parameters)


def gguf_weights(tensors: list, dtype: str) -> QuantizedWeights:
    """QuantizedWeights of a GGUF's tensor table (gguf_header.GGUFTensor). A tied embedding (no
    output.weight) is held once: the same codes serve the embedding and the LM head."""
    loaded = file_bytes = params = largest = 0
    types: dict[str, int] = {}
    for t in tensors:
        loaded += tensor_bytes(t.type_name, t.shape, dtype, half_scales(dtype))
        file_bytes += t.nbytes
        params += t.elements
        largest = max(largest, t.nbytes)
        types[t.type_name] = types.get(t.type_name, 0) + t.elements
    return QuantizedWeights("gguf", file_bytes, loaded, largest, params, types)
