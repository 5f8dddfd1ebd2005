"""Start-up path: what a warm `tokenmill serve` start skips or reuses, checked by what it produces."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from tokenmill.engine.model.loader import materialize


def test_materialize_matches_to_empty_and_keeps_shared_tensors_shared() -> None:
    with torch.device("meta"):
        m = torch.nn.Module()
        m.a = torch.nn.Linear(4, 3)
        m.b = torch.nn.Linear(4, 3, bias=False)
        m.b.weight = m.a.weight  # tied, like an LM head on the embedding
        m.register_buffer("ids", torch.zeros(5, dtype=torch.int64))
        m.register_buffer("table", torch.zeros(2, 4))
    m.a.bias.requires_grad_(False)
    reference = {k: (v.shape, v.dtype) for k, v in copy.deepcopy(m).to(torch.bfloat16).state_dict().items()}
    assert m.table.dtype == torch.float32
    materialize(m, torch.bfloat16, torch.device("cpu"))
    assert m.b.weight is m.a.weight
    assert isinstance(m.a.weight, torch.nn.Parameter) and m.a.weight.requires_grad
    assert not m.a.bias.requires_grad
    got = {k: (v.shape, v.dtype) for k, v in m.state_dict().items()}
    assert got == reference  # ids stays int64, floating tensors become bf16
    assert {t.device.type for t in m.state_dict().values()} == {"cpu"}


def test_gguf_cache_is_keyed_by_content_not_by_path(tmp_path, monkeypatch) -> None:
    from tokenmill.engine.model import gguf_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((a, b"GGUF same bytes"), (b, b"GGUF same bytes"), (c, b"GGUF other bytes")):
        path.parent.mkdir()
        path.write_bytes(data)
    # Another venv's copy of the same file (another path, another mtime) finds the same conversion.
    assert gguf_cache.gguf_cache_dir(a) == gguf_cache.gguf_cache_dir(b)
    assert gguf_cache.gguf_cache_dir(a) != gguf_cache.gguf_cache_dir(c)
    assert len(list((tmp_path / "cache" / "tokenmill" / "digests").iterdir())) == 3
    # A rewritten file (new mtime) is hashed again, not answered from the memo.
    c.write_bytes(b"GGUF same bytes")
    os.utime(c, ns=(1, 1))
    assert gguf_cache.gguf_cache_dir(c) == gguf_cache.gguf_cache_dir(a)


def test_resolve_model_if_ready_answers_only_when_no_work_is_needed(tmp_path, monkeypatch) -> None:
    from tokenmill.engine.model.resolve import resolve_model_if_ready

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "hf"
    folder.mkdir()
    assert resolve_model_if_ready(str(folder)) is None  # no config.json: resolve_model says why
    (folder / "config.json").write_text("{}")
    assert resolve_model_if_ready(str(folder)) == folder
    assert resolve_model_if_ready(f"file://{folder}") == folder
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_if_ready(str(gguf)) is None  # not converted yet
    assert resolve_model_if_ready("hf://org/name") is None  # the hub is asked by resolve_model only
    assert resolve_model_if_ready(str(tmp_path / "missing")) is None


def test_bench_startup_reports_a_real_start_whose_engine_core_launched_before_the_web_stack(
    bundled_model_dir,
) -> None:
    """A warm start (the bundled model converted already) launches the engine core before the API
    process's own imports, and the ready line reports the core's start-up phases."""
    from tokenmill.engine.bench.startup import run_startup_bench

    args = ["--max-model-len", "256", "--num-kv-blocks", "16", "--max-num-seqs", "2", "--dtype", "float32"]
    report = run_startup_bench(args, runs=1, discard_first=False, timeout_s=300)
    (run,) = report["runs"]
    assert run["exit_code"] == 0
    assert run["first_http_answer_s"] <= run["health_200_s"]
    assert run["engine_core_launched_s"] < run["api_listening_s"]
    phases = [p for p in run["engine_core_phases_s"] if p in ("imports", "config", "kernels", "weights", "runner")]
    assert phases == ["imports", "config", "kernels", "weights", "runner"], run["engine_core_phases_s"]


def test_a_built_kernel_library_is_loaded_directly_without_cpp_extension(tmp_path) -> None:
    """Once built, a new process loads the kernels' .so itself: no torch.utils.cpp_extension (setuptools,
    a ninja run: 0.2 s of a start), and the ops work."""
    from tokenmill.kernels import cpu

    if cpu.load() is None:
        pytest.skip(f"no C++ kernels on this machine: {cpu.unavailable_reason()}")
    code = (
        "import sys, torch; from tokenmill.kernels import cpu; ops = cpu.load(); "
        "x = torch.randn(3, 64); out = torch.empty_like(x); ops.rms_norm(out, x, torch.ones(64), 1e-5); "
        "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5); "
        "print(ops is not None, 'torch.utils.cpp_extension' in sys.modules, torch.allclose(out, ref, atol=1e-5))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "True"], out.stderr


def test_weight_blocks_read_back_from_the_cache_equal_freshly_found_ones(bundled_model_dir, tmp_path, monkeypatch):
    from tokenmill.engine.layers import weight_codes
    from tokenmill.engine.model import weight_codes_cache
    from tokenmill.engine.model.loader import load_model
    from tokenmill.kernels import cpu

    if cpu.load() is None:
        pytest.skip(f"no C++ kernels on this machine: {cpu.unavailable_reason()}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = load_model(bundled_model_dir)
    params = dict(model.named_parameters())
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight", "model.layers.29.mlp.down_proj.weight"]
    fresh = {n: weight_codes.find_weight_codes(params[n]) for n in names}  # no cache active
    assert all(b is not None for b in fresh.values())

    def find_with(cache: weight_codes_cache.WeightCodesCache) -> dict:
        return {n: weight_codes.find_weight_codes(params[n], cache) for n in names}

    first = weight_codes_cache.open_cache(model, bundled_model_dir, cpu.build_name())
    find_with(first)
    assert first.hits == 0 and sorted(first.found) == sorted(names)
    weight_codes_cache.save_cache(first)
    second = weight_codes_cache.open_cache(model, bundled_model_dir, cpu.build_name())
    cached = find_with(second)
    assert second.hits == len(names)
    for n in names:
        for part in ("codes", "scales", "mins"):
            assert torch.equal(getattr(cached[n], part), getattr(fresh[n], part)), (n, part)
    # Other kernel code: another file, so nothing is read back.
    assert weight_codes_cache.open_cache(model, bundled_model_dir, "tokenmill_cpu_other").stored == {}
