"""Shared test setup: one torch thread (several engineers share two cores) and the bundled model folder."""

import pathlib

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def bundled_model_dir() -> pathlib.Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the user's cache (reused across runs)."""
    from tokenmill.engine.model_loader import resolve_model

    return resolve_model(None)
