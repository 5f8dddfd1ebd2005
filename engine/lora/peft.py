"""A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) read and checked against the base
model, torch-free: the API process refuses a bad adapter with a 400 before the engine sees it, and the
engine core runs the same check before any rank loads a tensor.

Supported: plain LoRA (PEFT's `LoraConfig`) on q/k/v/o and gate/up/down projections, any rank up to
`max_lora_rank`, alpha / r scaling or rank-stabilized alpha / sqrt(r) (`use_rslora`). Refused, each by
name: DoRA, bias training, modules_to_save, per-module rank or alpha patterns, fan_in_fan_out, adapters
on other modules (embeddings, the LM head, another architecture's names) and tensors whose shapes are not
the base model's.
"""

import json
import pathlib
import re
from dataclasses import dataclass

from tokenmill.engine.load_memory import TensorInfo, read_header
from tokenmill.engine.lora_memory import LORA_TARGET_MODULES
from tokenmill.engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_BYTES = 4096  # PATH_MAX: a path travels with every step that uses the adapter
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_FLOAT_DTYPES = ("F32", "BF16", "F16")


class LoRAAdapterError(ValueError):
    """An adapter this engine cannot serve; the message names the adapter, the problem and the limit."""


@dataclass(frozen=True, slots=True)
class AdapterTensors:
    a: TensorInfo  # lora_A [r, in]
    b: TensorInfo  # lora_B [out, r]


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    path: pathlib.Path
    rank: int  # the largest rank of any target
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # those with tensors, in LORA_TARGET_MODULES order
    tensors: dict[tuple[int, str], AdapterTensors]  # (layer, module) -> its A and B


def module_shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT target module -> (in, out) features of its base projection, unsharded."""
    kv = mc.num_key_value_heads * mc.head_dim
    h, inter = mc.hidden_size, mc.intermediate_size
    return {
        "q_proj": (h, mc.q_size), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (mc.q_size, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip


def check_lora_name(name: str) -> None:
    if not name or len(name) > MAX_LORA_NAME_CHARS or name != name.strip() or "," in name:
        raise LoRAAdapterError(
            f"LoRA adapter name {name[:80]!r} is not valid: 1 to {MAX_LORA_NAME_CHARS} characters, no commas "
            "(vllm:lora_requests_info lists names comma-separated) and no surrounding spaces"
        )


def read_adapter(path: str | pathlib.Path, mc: ModelConfig, max_lora_rank: int, name: str = "") -> AdapterInfo:
    """The adapter at `path`, checked against the model; raises LoRAAdapterError naming what is wrong."""
    label = f"LoRA adapter {name!r} ({path})" if name else f"LoRA adapter {path}"
    folder = pathlib.Path(path)
    if len(str(folder).encode()) > MAX_LORA_PATH_BYTES:
        raise LoRAAdapterError(f"{label}: the path is longer than {MAX_LORA_PATH_BYTES} bytes")
    if not folder.is_dir():
        raise LoRAAdapterError(f"{label}: no such folder")
    config = _read_config(folder / CONFIG_FILE, label)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        other = [p.name for p in folder.glob("adapter_model.*")]
        hint = f" (found {', '.join(other)}: only safetensors are loaded)" if other else ""
        raise LoRAAdapterError(f"{label}: no {WEIGHTS_FILE}{hint}")
    _check_features(config, label, mc)
    try:
        header = read_header(weights)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} cannot be read: {e}") from None
    shapes = module_shapes(mc)
    parts: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    for info in header:
        m = _KEY.match(info.name)
        if m is None:
            module = _module_of(info.name)
            raise LoRAAdapterError(
                f"{label}: tensor {info.name!r} targets {module!r}, which this engine cannot adapt on "
                f"{mc.architecture}; supported target modules: {', '.join(LORA_TARGET_MODULES)}"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise LoRAAdapterError(
                f"{label}: it targets module {module!r}, which {mc.architecture} does not have; supported "
                f"target modules: {', '.join(LORA_TARGET_MODULES)}"
            )
        if layer >= mc.num_hidden_layers:
            raise LoRAAdapterError(
                f"{label}: tensor {info.name!r} is for layer {layer}, but the model has {mc.num_hidden_layers} layers"
            )
        if info.dtype not in _FLOAT_DTYPES:
            raise LoRAAdapterError(f"{label}: tensor {info.name!r} is {info.dtype}; expected one of {_FLOAT_DTYPES}")
        parts.setdefault((layer, module), {})[which] = info
    if not parts:
        raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} holds no LoRA tensors")
    tensors: dict[tuple[int, str], AdapterTensors] = {}
    rank = 0
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{label}: layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0] if len(a.shape) == 2 else -1
        if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r) or r < 1:
            raise LoRAAdapterError(
                f"{label}: layer {layer} {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this "
                f"model needs [r, {fan_in}] and [{fan_out}, r] (is the adapter for another base model?)"
            )
        if r > max_lora_rank:
            raise LoRAAdapterError(
                f"{label}: its rank is {r} (layer {layer} {module}), above --max-lora-rank {max_lora_rank}; "
                f"serve it with --max-lora-rank {r} or more"
            )
        rank = max(rank, r)
        tensors[(layer, module)] = AdapterTensors(a, b)
    present = {module for _, module in tensors}
    return AdapterInfo(
        path=folder,
        rank=rank,
        lora_alpha=float(config.get("lora_alpha", 8)),
        use_rslora=bool(config.get("use_rslora", False)),
        target_modules=tuple(t for t in LORA_TARGET_MODULES if t in present),
        tensors=tensors,
    )


def _read_config(file: pathlib.Path, label: str) -> dict:
    if not file.is_file():
        raise LoRAAdapterError(f"{label}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{label}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{label}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_features(config: dict, label: str, mc: ModelConfig) -> None:
    """Refuse the PEFT options that change the computation beyond x @ A.T @ B.T * scale."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"{label}: peft_type is {peft_type!r}; only LORA adapters are served")
    unsupported = [
        ("use_dora", bool(config.get("use_dora")), "DoRA (use_dora)"),
        ("bias", config.get("bias", "none") not in (None, "none"), f"trained biases (bias={config.get('bias')!r})"),
        ("lora_bias", bool(config.get("lora_bias")), "a bias on lora_B (lora_bias)"),
        ("modules_to_save", bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')}"),
        ("rank_pattern", bool(config.get("rank_pattern")), "per-module ranks (rank_pattern)"),
        ("alpha_pattern", bool(config.get("alpha_pattern")), "per-module alphas (alpha_pattern)"),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out")), "fan_in_fan_out weights"),
        ("target_parameters", bool(config.get("target_parameters")), "target_parameters"),
        ("trainable_token_indices", bool(config.get("trainable_token_indices")), "trainable_token_indices"),
    ]
    for _key, present, what in unsupported:
        if present:
            raise LoRAAdapterError(f"{label}: it uses {what}, which this engine does not serve")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            module = str(t).rsplit(".", 1)[-1]
            if module not in LORA_TARGET_MODULES:
                raise LoRAAdapterError(
                    f"{label}: target module {t!r} is not one {mc.architecture} has or this engine adapts; "
                    f"supported target modules: {', '.join(LORA_TARGET_MODULES)}"
                )
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAAdapterError(f"{label}: lora_alpha must be a positive number, got {alpha!r}")


def _module_of(key: str) -> str:
    """The module a tensor name names: the part before .lora_A/.lora_B, else the last part before .weight."""
    stem = key.split(".lora_")[0] if ".lora_" in key else key.rsplit(".", 1)[0]
    return stem.rsplit(".", 1)[-1]
