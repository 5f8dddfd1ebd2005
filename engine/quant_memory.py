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


def fp32_panel_bytes(rows: int, cols: int, bf16_exact: bool) -> int:
    """Bytes of a [rows, cols] weight an fp32 CPU model packs for the fp32 kernel (cpu_linear.cpp): bf16
    panels alone where every value is a bf16 value (a bf16 checkpoint), else fp32 panels beside the fp32
    weight that torch's GEMM reads for batches of more rows than the kernel takes."""
    n = _panel_rows(rows)
    return n * cols * 2 if bf16_exact else n * cols * 4 + rows * cols * 4


def tensor_bytes(
    type_name: str, shape: tuple[int, ...], dtype: str, half_scales: bool, codes: bool = True, packed: bool = False
) -> int:
    """Bytes one GGUF tensor takes once loaded for a model served in `dtype` (`codes`: where the engine
    keeps codes, a CPU serving fp32 or bf16; elsewhere every tensor is dequantized to the dtype). packed:
    a float tensor the fp32 kernel packs there (a linear's weight, or a tied embedding's)."""
    elements = 1
    for d in shape:
        elements *= d
    if not codes and type_name in SUPPORTED_GGUF:
        return elements * kv_memory.dtype_bytes(dtype)
    if packed and dtype == "float32" and len(shape) == 2 and type_name in FLOAT_GGUF:
        return fp32_panel_bytes(*shape, bf16_exact=type_name == "BF16")
    if len(shape) == 2 and type_name in GROUPED_GGUF:
        return grouped_bytes(GROUPED_GGUF[type_name], *shape)
    if len(shape) == 2 and type_name in CODES_GGUF:
        return codes_bytes(CODES_GGUF[type_name], *shape, half_scales)
    if type_name not in SUPPORTED_GGUF:
        raise ValueError(f"GGUF tensor type {type_name} is not supported; supported: {', '.join(sorted(SUPPORTED_GGUF))}")
    return elements * kv_memory.dtype_bytes(dtype)


def codes_held(device_type: str, dtype: str, tensor_parallel: int, bf16_dot: bool) -> bool:
    """Whether the engine keeps quantized weights as codes (model/gguf_weights.codes_supported adds that
    the C++ kernels built): on a CPU rank holding every weight (no tensor parallelism) serving fp32, or
    bf16 where the CPU has AVX-512 BF16. Elsewhere they are dequantized to the dtype at load."""
    if device_type != "cpu" or tensor_parallel != 1:
        return False
    return dtype == "float32" or (dtype == "bfloat16" and bf16_dot)


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


def gguf_weights(tensors: list, dtype: str, codes: bool = True) -> QuantizedWeights:
    """QuantizedWeights of a GGUF's tensor table (gguf_header.GGUFTensor). A tied embedding (no
    output.weight) is held once: the same codes serve the embedding and the LM head."""
    loaded = file_bytes = params = largest = 0
    types: dict[str, int] = {}
    tied = not any(t.name == "output.weight" for t in tensors)
    for t in tensors:
        packed = t.name != "token_embd.weight" or tied  # every other 2-D tensor is a linear's
        loaded += tensor_bytes(t.type_name, t.shape, dtype, half_scales(dtype), codes, packed)
        file_bytes += t.nbytes
        params += t.elements
        largest = max(largest, t.nbytes)
        types[t.type_name] = types.get(t.type_name, 0) + t.elements
    return QuantizedWeights("gguf", file_bytes, loaded, largest, params, types)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor a Llama-family checkpoint with this config.json stores."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
    out = [("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, hidden)))
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
        for name, shape in shapes.items():
            kind = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out.append((f"{p}{kind}.{name}.weight", shape))
            if bias and name in ("q_proj", "k_proj", "v_proj"):
                out.append((f"{p}{kind}.{name}.bias", (shape[0],)))
        if config.get("model_type") == "qwen3":
            out += [(p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,))]
    return out


@dataclass(frozen=True, slots=True)
class Int4Config:
    """An AWQ / GPTQ int4 checkpoint's quantization, as the loader (model/int4_weights.py) reads it."""

    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group per column (the whole input)
    zero_plus_one: bool  # GPTQ's v1 format stores z - 1


def int4_config(config: dict, where: str = "config.json") -> Int4Config | None:
    """The AWQ / GPTQ int4 quantization of a config.json, None for an unquantized checkpoint; ValueError
    for one the engine cannot serve, naming it and what is supported. The loader, `serve --check` and the
    operator all ask this, so none of them accepts a checkpoint another refuses."""
    raw = config.get("quantization_config")
    if raw is None:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(f"{where}: quantization_config quant_method {method!r} is not supported; supported: awq, gptq")
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: {method} with {bits}-bit weights is not supported; supported: 4 bits")
    group = raw.get("group_size", raw.get("q_group_size", 128))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise ValueError(f"{where}: {method} group_size {group!r} is not supported; supported: multiples of 32, or -1")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm" or raw.get("zero_point", True) is not True:
            raise ValueError(f"{where}: AWQ version {version!r} (zero_point {raw.get('zero_point')}) is not supported; "
                             "supported: version gemm with zero points")  # fmt: skip
        return Int4Config("awq", group, False)
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
    if raw.get("desc_act") is True:  # the loader would find a permuted g_idx; without weights, say it now
        raise ValueError(f"{where}: GPTQ with act-order (desc_act: true) is not supported; quantize without desc_act")
    return Int4Config("gptq", group, fmt == "gptq")


def check_int4_parallel(config: dict, tensor_parallel: int, where: str = "config.json") -> None:
    """Refuse an AWQ / GPTQ checkpoint split by tensor parallelism: the loader builds each quantized
    projection whole (pipeline stages are fine: a stage takes whole layers)."""
    cfg = int4_config(config, where)
    if cfg is not None and tensor_parallel > 1:
        raise ValueError(f"{where}: {cfg.method} int4 checkpoints are not supported with tensor parallelism "
                         f"(tensor_parallel_size={tensor_parallel}); use 1 GPU per pipeline stage")  # fmt: skip


def int4_group_size(config: dict) -> int | None:
    """The AWQ / GPTQ group size of a config.json's quantization_config (-1: the whole input row), or None
    when its weights are not int4; ValueError for a quantization the engine refuses (int4_config)."""
    cfg = int4_config(config)
    return None if cfg is None else cfg.group_size


def config_weights(config: dict, dtype: str, codes: bool) -> QuantizedWeights:
    """QuantizedWeights of a safetensors checkpoint from its config.json alone (what `serve --check` and the
    operator have): AWQ / GPTQ projections as grouped codes where the engine keeps codes (`codes`: a CPU
    serving fp32 or bf16), else every weight in the served dtype (on a GPU the engine dequantizes int4
    weights at load: there are no GPU codes kernels yet). file_bytes: int4 projections at 4 bits plus an
    fp16 scale and a packed zero per group, the rest in fp16 (AWQ and GPTQ checkpoints store fp16)."""
    group = int4_group_size(config)
    stored_dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    file_elem = 2 if group is not None else kv_memory.DTYPE_BYTES.get(stored_dtype, 2)
    loaded = file_bytes = params = largest = 0
    types: dict[str, int] = {}
    tied = bool(config.get("tie_word_embeddings", False))
    for name, shape in config_tensors(config):
        elements = 1
        for d in shape:
            elements *= d
        params += elements
        quantized = group is not None and name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS
        if quantized:
            g = shape[1] if group == -1 else group
            stored = elements // 2 + elements // g * 2 + elements // g // 2
            held = grouped_bytes(int4_group_format(g), *shape) if codes else elements * kv_memory.dtype_bytes(dtype)
            kind = "int4"
        else:
            stored = elements * file_elem
            held = elements * kv_memory.dtype_bytes(dtype)
            if codes and dtype == "float32" and len(shape) == 2 and (name != "model.embed_tokens.weight" or tied):
                held = fp32_panel_bytes(*shape, bf16_exact=group is None and stored_dtype == "bfloat16")
            kind = dtype
        loaded += held
        file_bytes += stored
        largest = max(largest, stored)
        types[kind] = types.get(kind, 0) + elements
    method = str((config.get("quantization_config") or {}).get("quant_method", "none")).lower()
    return QuantizedWeights(method if group is not None else "none", file_bytes, loaded, largest, params, types)
