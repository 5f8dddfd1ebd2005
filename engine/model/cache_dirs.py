"""Where tokenmill keeps what it derives from models on disk: ~/.cache/tokenmill (XDG_CACHE_HOME honoured).
Converted GGUF folders go under models/, file digests under digests/, weight codes under blocks/."""

import os
import pathlib


def tokenmill_cache() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tokenmill"


def cache_root() -> pathlib.Path:
    """The folder of converted models (GGUF -> Hugging Face folders)."""
    return tokenmill_cache() / "models"
