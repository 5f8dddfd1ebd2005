"""Built-in catalogs: GPU types and model architecture profiles, plus profiles from config.json.

Numbers are the real ones: GPU memory is what `nvidia-smi --query-gpu=memory.total` reports (MiB), the
product names are the `nvidia.com/gpu.product` label values that GPU feature discovery sets (the
nvidia-smi name with spaces turned into dashes), and model numbers come from each model's config.json
and the parameter count of its safetensors index.
"""

import re
from dataclasses import dataclass, field, fields

from tokenmill.engine import quant_memory

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class GPUType:
    name: str  # the value of spec.resources.gpu.type
    memory_mib: int
    products: tuple[str, ...]  # nvidia.com/gpu.product values of this type
    # GPUs on one node of the largest common shape (p5/a3/ND H100 v5: 8; g5/g6.48xlarge and g2-96: 8).
    # A replica needing more runs as one pod per node (tensor parallel inside, pipeline parallel across).
    gpus_per_node: int = 8
    # CUDA compute capability: which KV cache dtypes the engine runs on it (kv_memory.kv_cache_dtype_fits_gpu).
    compute_capability: tuple[int, int] = (8, 0)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


GPU_TYPES: dict[str, GPUType] = {
    gpu.name: gpu
    for gpu in (
        GPUType("nvidia-a10g", 23028, ("NVIDIA-A10G",), compute_capability=(8, 6)),
        GPUType("nvidia-l4", 23034, ("NVIDIA-L4",), compute_capability=(8, 9)),
        GPUType("nvidia-a100-40gb", 40960, ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"), compute_capability=(8, 0)),
        GPUType("nvidia-a100-80gb", 81920, ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"), compute_capability=(8, 0)),
        GPUType("nvidia-h100-80gb", 81559, ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"), compute_capability=(9, 0)),
        GPUType("nvidia-h200-141gb", 143771, ("NVIDIA-H200", "NVIDIA-H200-NVL"), compute_capability=(9, 0)),
    )
}

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What sizing needs to know about a model; field names follow Hugging Face's config.json."""

    name: str
    num_parameters: int
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    aliases: tuple[str, ...] = field(default=(), compare=False)
    source: str = "catalog"  # catalog | spec | catalog+spec | hub | hub+spec | config.json | file
    # "awq" or "gptq" with its group size ("awq-g128"): int4 projections (config.json's quantization_config);
    # "" for weights stored as they are served. Sizing counts its bytes with quant_memory (sizing.py).
    quantization: str = ""
    attention_bias: bool = False  # Q, K and V biases (Qwen2): part of the parameter count


MODEL_PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile(
            "SmolLM2-135M", 134_515_008, 30, 576, 9, 3, 64, 1536, 49152, 8192,
            tie_word_embeddings=True, aliases=("smollm2-135m",),
        ),
        ModelProfile(
            "Llama-3.1-8B", 8_030_261_248, 32, 4096, 32, 8, 128, 14336, 128256, 131072,
            aliases=("llama-3.1-8b", "meta-llama-3.1-8b"),
        ),
        # In bfloat16 its 812 GB of weights need two nodes of 8 x 80 GB (a multi-node replica). The Hub is
        # not reachable here: the parameter count is estimate_num_parameters() of this config.json shape.
        ModelProfile(
            "Llama-3.1-405B", 405_853_388_800, 126, 16384, 128, 8, 128, 53248, 128256, 131072,
            aliases=("llama-3.1-405b", "meta-llama-3.1-405b"),
        ),
        ModelProfile(
            "Llama-3.1-70B", 70_553_706_496, 80, 8192, 64, 8, 128, 28672, 128256, 131072,
            aliases=("llama-3.1-70b", "meta-llama-3.1-70b"),
        ),
        # Qwen2.5's Instruct configs declare 32768 positions (the base configs say 131072, reachable
        # only with YaRN rope scaling, which the engine does not implement).
        ModelProfile(
            "Qwen2.5-7B", 7_615_616_512, 28, 3584, 28, 4, 128, 18944, 152064, 32768,
            aliases=("qwen2.5-7b",),
        ),
        ModelProfile(
            "Qwen2.5-72B", 72_706_203_648, 80, 8192, 64, 8, 128, 29568, 152064, 32768,
            aliases=("qwen2.5-72b",),
        ),
        # v0.3: 32768-token vocabulary and no sliding window (the engine has no sliding window).
        ModelProfile(
            "Mistral-7B", 7_248_023_552, 32, 4096, 32, 8, 128, 14336, 32768, 32768,
            aliases=("mistral-7b", "mistral-7b-v0.3"),
        ),
    )
}

_QUANT_SUFFIX = re.compile(r"\.(q\d[\w]*|iq\d[\w]*|f16|bf16|f32)$")


def normalize_model_name(name_or_uri: str) -> str:
    """`hf://meta-llama/Llama-3.1-8B-Instruct`, `pvc://models/llama-3.1-8b-instruct/` -> `llama-3.1-8b`."""
    base = name_or_uri.rstrip("/").rsplit("/", 1)[-1].lower()
    base = base.removesuffix(".gguf")
    base = _QUANT_SUFFIX.sub("", base)
    # Fine-tune tags do not change the architecture: Mistral-7B-Instruct-v0.3 is mistral-7b-v0.3.
    return "-".join(t for t in base.split("-") if t not in ("instruct", "chat", "it"))


def find_model_profile(name_or_uri: str) -> ModelProfile | None:
    """The catalog profile whose name or alias matches the last path segment of a name or URI."""
    key = normalize_model_name(name_or_uri)
    for profile in MODEL_PROFILES.values():
        if key == profile.name.lower() or key in profile.aliases:
            return profile
    return None


# --- profiles from a Hugging Face config.json, or from spec.model.profile (camelCase) ---

# ModelProfile field -> spec.model.profile key
SPEC_KEYS: dict[str, str] = {
    "num_parameters": "parameters",
    "num_hidden_layers": "layers",
    "hidden_size": "hiddenSize",
    "num_attention_heads": "numAttentionHeads",
    "num_key_value_heads": "numKeyValueHeads",
    "head_dim": "headDim",
    "intermediate_size": "intermediateSize",
    "vocab_size": "vocabSize",
    "max_position_embeddings": "maxPositionEmbeddings",
    "tie_word_embeddings": "tieWordEmbeddings",
}
# Needed when no catalog entry is the base; the rest have defaults or are estimated.
REQUIRED_FIELDS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
    "max_position_embeddings",
)


class ProfileError(ValueError):
    """A profile that cannot be used; `reason` is the status condition reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def estimate_num_parameters(
    num_hidden_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
) -> int:
    """Parameters of a Llama-shaped decoder (Llama, Mistral, Qwen2 with attention_bias, SmolLM2)."""
    q, kv = num_attention_heads * head_dim, num_key_value_heads * head_dim
    attention = hidden_size * (q + 2 * kv) + q * hidden_size
    if attention_bias:
        attention += q + 2 * kv
    mlp = 3 * hidden_size * intermediate_size
    per_layer = attention + mlp + 2 * hidden_size  # two RMSNorm weights
    embeddings = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    return num_hidden_layers * per_layer + embeddings + hidden_size  # + the final norm


def _complete(values: dict, name: str, source: str, attention_bias: bool = False) -> ModelProfile:
    missing = [SPEC_KEYS[f] for f in REQUIRED_FIELDS if values.get(f) is None]
    if missing:
        raise ProfileError(
            "IncompleteModelProfile",
            f"model profile for {name!r} lacks {', '.join(missing)}: add them to spec.model.profile "
            "(the numbers are in the model's config.json)",
        )
    v = dict(values)
    if v.get("num_key_value_heads") is None:
        v["num_key_value_heads"] = v["num_attention_heads"]
    heads = v["num_attention_heads"]
    if v.get("head_dim") is None and isinstance(heads, int) and heads > 0:
        v["head_dim"] = v["hidden_size"] // heads
    v["tie_word_embeddings"] = bool(v.get("tie_word_embeddings") or False)
    for key in (*REQUIRED_FIELDS, "num_key_value_heads", "head_dim", "num_parameters"):
        value = v.get(key)
        if key == "num_parameters" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ProfileError("InvalidModelProfile", f"{SPEC_KEYS[key]} must be a positive integer, got {value!r}")
    if v["num_attention_heads"] % v["num_key_value_heads"]:
        raise ProfileError(
            "InvalidModelProfile",
            f"numAttentionHeads {v['num_attention_heads']} is not a multiple of numKeyValueHeads "
            f"{v['num_key_value_heads']}",
        )
    if v.get("num_parameters") is None:
        v["num_parameters"] = estimate_num_parameters(
            v["num_hidden_layers"], v["hidden_size"], v["num_attention_heads"], v["num_key_value_heads"],
            v["head_dim"], v["intermediate_size"], v["vocab_size"], v["tie_word_embeddings"], attention_bias,
        )
    v["attention_bias"] = attention_bias
    own = ("name", "source", "aliases")
    kwargs = {f.name: v[f.name] for f in fields(ModelProfile) if f.name in v and f.name not in own}
    return ModelProfile(name=name, source=source, **kwargs)


def profile_from_hf_config(config: dict, name: str = "model", num_parameters: int | None = None,
                           source: str = "config.json") -> ModelProfile:
    """A profile from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3 style); the parameter
    count is estimated from the shape unless given (the Hub's safetensors metadata has it)."""
    values = {f: config.get(f) for f in SPEC_KEYS if f != "num_parameters"}
    try:  # the engine's own rule: a quantization it refuses at load (or in `serve --check`) is refused here
        cfg = quant_memory.int4_config(config, f"{name} config.json")
    except ValueError as e:
        raise ProfileError("UnsupportedQuantization", str(e)) from None
    group = None if cfg is None else cfg.group_size
    # An AWQ / GPTQ checkpoint's safetensors count holds eight int4 weights per int32 element: the shape
    # says how many weights there are.
    values["num_parameters"] = num_parameters if group is None else None
    if group is not None:
        values["quantization"] = f"{cfg.method}-g{group}"
    # Qwen2 has biases on Q, K and V; Llama-style configs say so with attention_bias.
    bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
    return _complete(values, name, source, attention_bias=bias)


def profile_from_spec(spec_profile: dict | None, base: ModelProfile | None, name: str) -> ModelProfile:
    """spec.model.profile over an optional catalog base: given keys override, absent keys inherit."""
    spec_profile = spec_profile or {}
    if base is None and not spec_profile:
        raise ProfileError(
            "UnknownModelProfile",
            f"model {name!r} is not in the catalog ({', '.join(MODEL_PROFILES)}): set spec.model.profile "
            "with layers, hiddenSize, numAttentionHeads, numKeyValueHeads, intermediateSize, vocabSize and "
            "maxPositionEmbeddings from its config.json (or profile.base to start from a catalog model)",
        )
    values = {} if base is None else {f.name: getattr(base, f.name) for f in fields(ModelProfile)}
    overridden = False
    for attr, key in SPEC_KEYS.items():
        if spec_profile.get(key) is not None:
            values[attr] = spec_profile[key]
            overridden = True
    if base is not None and not overridden:
        return base
    if base is not None and "parameters" not in spec_profile and _shape_changed(base, values):
        values["num_parameters"] = None  # the base's count no longer describes this shape
    if base is None:
        return _complete(values, name, "spec")
    return _complete(values, base.name, f"{base.source}+spec")


def _shape_changed(base: ModelProfile, values: dict) -> bool:
    shape = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "tie_word_embeddings")
    return any(values.get(k) != getattr(base, k) for k in shape)


def profile_config(p: ModelProfile) -> dict:
    """The config.json fields of a profile, as engine/quant_memory.py reads them (its quantization too)."""
    config = {f: getattr(p, f) for f in SPEC_KEYS if f != "num_parameters"}
    config["attention_bias"] = p.attention_bias
    if p.quantization:
        method, group = p.quantization.split("-g")
        config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": int(group)}
    return config
