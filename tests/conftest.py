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


# The modules whose paths depend on the CPU tier: make test runs them again under each lower
# TOKENMILL_CPU_TIER (kernels/cpu_probe.py). One list, so a new kernel test is added here once.
CPU_TIER_MODULES = {
    "test_attention_cpu_direct", "test_cpu_probe", "test_decoder_layers_cpu", "test_gemm_cpu", "test_kernels_cpu",
    "test_kernels_kv8", "test_layers_cpu", "test_linear_bf16_codes", "test_linear_bf16_dot", "test_linear_cpu",
    "test_linear_dense_bf16", "test_codes_int8", "test_int8_activations", "test_grouped_linear_cpu",
    "test_model_loader", "test_quant_sizing",
    "test_topk_cpu",
}  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.stem in CPU_TIER_MODULES:
            item.add_marker(pytest.mark.cpu_tier)


def pytest_report_header(config) -> str:
    """Which CPU paths this run takes: the tier (capped or not) every CPU decision and test asks."""
    from tokenmill.kernels.cpu_probe import probe

    return probe().describe()


@pytest.fixture(scope="session")
def bundled_model_dir() -> pathlib.Path:
    """The bundled SmolLM2-135M-Instruct as a Hugging Face folder of fp32 safetensors, its GGUF blocks
    dequantized (the reference transformers and the engine's parity tests load), written once into the
    user's cache. The engine itself serves the GGUF's blocks: bundled_gguf_dir."""
    from tokenmill.engine.model.bundled import bundled_gguf_path
    from tokenmill.engine.model.gguf_cache import dequantized_copy_cached

    return dequantized_copy_cached(bundled_gguf_path())


@pytest.fixture(scope="session")
def bundled_gguf_dir() -> pathlib.Path:
    """What `tokenmill serve` loads by default: the bundled GGUF's folder (config, tokenizer, a link to the
    file), its weights read from the file's blocks."""
    from tokenmill.engine.model.resolve import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def bundled_checkpoint(bundled_model_dir, tmp_path_factory):
    """dtype -> the bundled model as a folder stored in that dtype: "float32" is the GGUF conversion itself,
    "bfloat16" / "float16" its weights cast as Hub repos ship them (tests/half_checkpoints.py), each
    written once per session on first use (about a second, 270 MB)."""
    from tests.half_checkpoints import cast_checkpoint

    made = {"float32": bundled_model_dir}

    def get(dtype: str) -> pathlib.Path:
        if dtype not in made:
            made[dtype] = cast_checkpoint(bundled_model_dir, tmp_path_factory.mktemp(f"bundled-{dtype}"), dtype)
        return made[dtype]

    return get
