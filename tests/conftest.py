"""Shared test setup: one torch thread (several engineers share two cores) and the bundled model folder."""

import os
import pathlib

# @triton.jit picks interpreted or compiled functions when triton.language is first imported, and
# anything (transformers, torch) may import it early in a long session. The interpreter tests need it
# interpreted from the start; on CPU nothing else runs Triton (impl="auto" uses the torch reference).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def bundled_model_dir() -> pathlib.Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the user's cache (reused across runs)."""
    from tokenmill.engine.model.resolve import resolve_model

    return resolve_model(None)
