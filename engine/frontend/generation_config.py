"""Default sampling parameters from the model's generation config, as vLLM's `--generation-config`.

`auto` reads generation_config.json from the model folder; `vllm` ignores it (the engine's own defaults:
temperature 1, no top-p/top-k); any other value is a folder holding a generation_config.json. Then
`--override-generation-config` (a JSON object) is laid over the result. Only the keys vLLM takes are
used (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens); `do_sample`
is ignored, as vLLM ignores it. A request's own values always win over these defaults.

Left unset, the mode is `auto` for every model but the bundled one. The bundled SmolLM2-135M-Instruct GGUF
carries no sampling settings (GGUF metadata has none, so the converted folder's generation_config.json
holds only token ids). Its model card's example samples at temperature 0.2 / top_p 0.9, at which the
135M model answers README's question in French, rambling, in about half of the tries; greedy answers it
right every time (measured in docs/serving.md, "Default sampling"). So unset, the bundled model decodes
greedily, and `--generation-config auto` gives it the card's values.
"""

import json
import logging
import pathlib
from typing import Any

from tokenmill.engine.config import parse_json_object

logger = logging.getLogger(__name__)

# HF generation_config.json key -> SamplingParams field (vLLM's list).
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# SmolLM2-135M-Instruct's model card: model.generate(..., temperature=0.2, top_p=0.9, do_sample=True).
# What `--generation-config auto` gives the bundled model, whose own file has no sampling values.
BUNDLED_MODEL_CARD: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9}
# What the bundled model gets when --generation-config is not given: greedy (the measurement above).
BUNDLED_MODEL_DEFAULTS: dict[str, Any] = {"temperature": 0.0}
BUNDLED_DEFAULTS_SOURCE = (
    "tokenmill's default for the bundled model (greedy; --generation-config auto for its card's "
    "temperature 0.2, top_p 0.9)"
)
MODES = ("auto", "vllm")


def read_generation_config(folder: str | pathlib.Path) -> dict[str, Any]:
    """generation_config.json of `folder` as a dict; {} when the folder has none."""
    path = pathlib.Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def parse_override(text: str | None) -> dict[str, Any]:
    """--override-generation-config: a JSON object of generation-config keys."""
    if not text:
        return {}
    data = parse_json_object(text, "--override-generation-config")
    unknown = sorted(set(data) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown keys {unknown}; use {', '.join(GENERATION_KEYS)}"
        )
    return data


def default_sampling_params(
    mode: str | None, model_dir: str | pathlib.Path, bundled: bool, override: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
    """(SamplingParams field -> default value, where they came from) for requests that leave them out.
    mode None: --generation-config not given (greedy for the bundled model, else `auto`)."""
    if mode is None and bundled:
        config, source = dict(BUNDLED_MODEL_DEFAULTS), BUNDLED_DEFAULTS_SOURCE
    elif mode is None:
        return default_sampling_params("auto", model_dir, bundled, override)
    elif mode == "vllm":
        config, source = {}, "the engine's defaults (--generation-config vllm)"
    elif mode == "auto":
        config = read_generation_config(model_dir)
        source = f"{pathlib.Path(model_dir) / 'generation_config.json'}"
        if bundled and not any(k in config for k in GENERATION_KEYS):
            config, source = dict(BUNDLED_MODEL_CARD), "the bundled model's card (SmolLM2-135M-Instruct)"
    else:
        folder = pathlib.Path(mode).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {mode}: no generation_config.json in that folder")
        config, source = read_generation_config(folder), str(folder / "generation_config.json")
    if override:
        config = {**config, **override}
        source += " with --override-generation-config"
    defaults = {field: config[key] for key, field in GENERATION_KEYS.items() if config.get(key) is not None}
    return defaults, source


def describe(defaults: dict[str, Any], source: str) -> str:
    """The startup log line."""
    if not defaults:
        return f"default sampling: none from {source}; requests without values get temperature=1.0, top_p=1.0"
    values = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return f"default sampling from {source}: {values} (a request's own values win)"
