"""Any model argument (a URI, a folder, a .gguf file, nothing) -> the local Hugging Face folder the engine
loads: a hub model downloaded, a GGUF's config and tokenizer converted (its weights stay in the file), once
each (cached). Imports no torch: the API process of `tokenmill serve` resolves models too, and importing
torch there costs about 500 MB of RSS. A first-time GGUF conversion still imports torch (gguf_convert.py);
a warm start finds the converted folder and does not.
"""

import os
import pathlib

from tokenmill.engine.model.bundled import bundled_gguf_path
from tokenmill.engine.model.gguf_cache import convert_gguf_cached, gguf_cache_dir, link_ok
from tokenmill.engine.model.hub_download import download_hf
from tokenmill.engine.model.source import (
    PVC_ROOT_ENV,
    ModelSource,
    ModelSourceError,
    parse_model_source,
    pvc_root,
)


def resolve_model(
    model: str | os.PathLike | None, revision: str | None = None, *, config_only: bool = False,
    progress: bool = False,
) -> pathlib.Path:
    """An HF-format folder for `model`, any form source.py accepts (hf://, ORG/NAME, pvc://, file://,
    bundled://, a local folder or .gguf file; None: the bundled model). Hub models are downloaded into
    the hub cache once; a .gguf is converted once (cached). config_only: a hub model's config.json alone.
    progress: huggingface_hub's progress bars while downloading (`tokenmill download`)."""
    source = parse_model_source(model, revision)
    path = resolve_model_source(source, config_only=config_only, progress=progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {path} has no config.json (expected a Hugging Face model folder)"
            )
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a Hugging Face folder")
    return convert_gguf_cached(path)


ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def resolve_adapter(path: str | os.PathLike) -> pathlib.Path:
    """A local folder for a LoRA adapter given as any form source.py accepts but bundled:// (hf:// and
    ORG/NAME download the adapter's two files into the hub cache, as models are)."""
    source = parse_model_source(path)
    if source.scheme == "bundled":
        raise ModelSourceError(f"{path!r} names the bundled model, not a LoRA adapter")
    if source.scheme == "hf":
        return download_hf(source, allow_patterns=ADAPTER_FILES)
    return resolve_model_source(source)


def resolve_model_if_ready(model: str | os.PathLike | None, revision: str | None = None) -> pathlib.Path | None:
    """The folder resolve_model(model, revision) returns, when finding it takes no download and no
    conversion (a local HF folder, a GGUF already converted); else None, also for anything resolve_model
    would refuse (it then says why). Fast: a few stat calls."""
    try:
        source = parse_model_source(model, revision)
        if source.scheme == "hf":
            return None
        path = bundled_gguf_path() if source.scheme == "bundled" else source.path
        if path is None:
            return None
        if path.is_dir():
            return path if (path / "config.json").is_file() else None
        if path.suffix.lower() == ".gguf" and path.is_file():
            final = gguf_cache_dir(path)
            return final if (final / "config.json").is_file() and link_ok(final, path) else None
    except (ModelSourceError, OSError, ValueError):
        pass
    return None


def resolve_model_source(
    source: ModelSource, *, config_only: bool = False, progress: bool = False
) -> pathlib.Path:
    """A local path for `source`: a folder (or a .gguf file for local sources) the loader can read.

    config_only: for a hub model fetch config.json alone (what `serve --check` needs, no weights).
    progress: show huggingface_hub's progress bars while downloading (`tokenmill download`).
    """
    if source.scheme == "hf":
        return download_hf(source, config_only=config_only, progress=progress)
    if source.scheme == "bundled":
        return bundled_gguf_path()  # a .gguf file: resolve_model converts it
    assert source.path is not None
    if not source.path.exists():
        if source.scheme == "pvc":
            raise FileNotFoundError(
                f"model {source.uri!r} not found: {source.path} does not exist (claims are mounted under "
                f"{pvc_root()}; set {PVC_ROOT_ENV} if yours is elsewhere)"
            )
        if source.scheme == "file":
            raise FileNotFoundError(
                f"model {source.uri!r} not found: {source.path} does not exist in this image"
            )
        raise FileNotFoundError(
            f"model {source.uri!r} not found: pass a local Hugging Face folder or a .gguf file, "
            "hf://ORG/NAME[@REVISION] or ORG/NAME"
        )
    return source.path
