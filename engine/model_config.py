"""The model's shape and numerics, parsed from a Hugging Face config.json.

Hugging Face writes config.json with `use_diff=True`, so a field equal to its class default is often
missing (Llama 2 has no rope_theta; tiny test configs have no tie_word_embeddings). The defaults
below are those of transformers' config classes for the fields we read.
"""

import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Per-architecture defaults for fields a config.json may omit (transformers' class defaults).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
    },
    "MistralForCausalLM": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "Qwen3ForCausalLM": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
}
_DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling (the only scaling type we implement)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama/Qwen3 attention_bias also puts a bias on o_proj; Qwen2 never does
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on each query and key head before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # We do not implement sliding-window attention. A model that uses it (Mistral v0.1: 4096) is exact
    # for sequences up to the window, so max_model_len is capped there instead of refusing the model.
    sliding_window: int | None

    @property
    def max_model_len(self) -> int:
        """Longest sequence this implementation computes exactly."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _positive_int(raw: dict[str, Any], key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters={"rope_type", "rope_theta", ...}; older files write a
    # top-level rope_theta and an optional rope_scaling dict ("type" or "rope_type").
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters/rope_scaling must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"config.json: rope scaling type {rope_type!r} is not supported; supported: 'default', 'llama3'"
        )
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"config.json: llama3 rope scaling is missing {', '.join(missing)}")
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", max_position_embeddings))
        ),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError(
            f"config.json: llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
            f"{scaling.high_freq_factor} <= {scaling.low_freq_factor}"
        )
    return float(theta), scaling


def _sliding_window(arch: str, raw: dict[str, Any], defaults: dict[str, Any], num_layers: int) -> int | None:
    if arch == "MistralForCausalLM":
        window = raw.get("sliding_window", defaults["sliding_window"])
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", defaults["use_sliding_window"]):
            return None
        # Qwen applies the window to the layers layer_types marks, by default those >= max_window_layers.
        layer_types = raw.get("layer_types")
        if isinstance(layer_types, list):
            if "sliding_attention" not in layer_types:
                return None
        elif raw.get("max_window_layers", defaults["max_window_layers"]) >= num_layers:
            return None
        window = raw.get("sliding_window", defaults["sliding_window"])
    else:
        return None
    if window is None:
        return None
    return _positive_int(raw, "sliding_window", window)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ValueError(f"config.json: eos_token_id must be an integer or a list of integers, got {value!r}")


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Parse an HF config dict; unknown architectures and unsupported features raise ValueError."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"config.json: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    defaults = _DEFAULTS[arch]

    def get(key: str) -> Any:
        return raw.get(key, defaults.get(key))

    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.json: hidden_act {hidden_act!r} is not supported; supported: 'silu'")
    if raw.get("mlp_bias", False):
        raise ValueError("config.json: mlp_bias=true is not supported")
    partial = raw.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor {partial} is not supported; supported: 1.0")

    hidden_size = _positive_int(raw, "hidden_size", get("hidden_size"))
    num_heads = _positive_int(raw, "num_attention_heads", get("num_attention_heads"))
    kv_heads = get("num_key_value_heads")
    num_kv_heads = num_heads if kv_heads is None else _positive_int(raw, "num_key_value_heads", kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config.json: num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
        )
    head_dim = get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(
                f"config.json: hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads} "
                "and no head_dim is given"
            )
        head_dim = hidden_size // num_heads
    head_dim = _positive_int(raw, "head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"config.json: head_dim must be even for RoPE, got {head_dim}")
    num_layers = _positive_int(raw, "num_hidden_layers", get("num_hidden_layers"))
    max_pos = _positive_int(raw, "max_position_embeddings", get("max_position_embeddings"))
    rope_theta, rope_scaling = _parse_rope(raw, max_pos)
    eps = float(get("rms_norm_eps"))
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"config.json: rms_norm_eps must be a positive number, got {eps}")

    attention_bias = bool(raw.get("attention_bias", defaults.get("attention_bias", False)))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch,
        vocab_size=_positive_int(raw, "vocab_size", get("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=_positive_int(raw, "intermediate_size", get("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=eps,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        qk_norm=arch == "Qwen3ForCausalLM",
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_ids(get("eos_token_id")),
        sliding_window=_sliding_window(arch, raw, defaults, num_layers),
    )


def load_model_config(model_dir: str | pathlib.Path) -> ModelConfig:
    """Read and parse <model_dir>/config.json."""
    path = pathlib.Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"model config not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model config {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model config {path} must hold a JSON object, got {type(raw).__name__}")
    return model_config_from_dict(raw)
