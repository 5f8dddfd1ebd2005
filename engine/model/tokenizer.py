"""A model folder's fast tokenizer (with its chat template), loadable without importing torch."""

import contextlib
import logging
import pathlib
import sys
from collections.abc import Iterator
from typing import Any


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
