"""Weights stream in one tensor at a time (model/loader.py): the result is bit for bit what loading whole
and then casting or packing gave, and the load's peak RSS stays within load_memory's bound."""

import pathlib

import pytest
import torch
from tokenmill.engine import load_memory
from tokenmill.engine.bench import load_peak
from tokenmill.engine.layers.linear import CpuPackedWeight, Linear
from tokenmill.engine.model.loader import load_model
from tokenmill.engine.model_config import load_model_config
from tokenmill.kernels import cpu as cpu_kernels

from tests.tiny_models import make_tiny_model

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ CPU kernels are not built here")


def _same_packed(a: CpuPackedWeight | None, b: CpuPackedWeight | None) -> bool:
    if a is None or b is None:
        return a is b
    parts = ("fp32", "codes", "scales", "mins")
    return all(
        (getattr(a, p) is None and getattr(b, p) is None)
        or (getattr(a, p) is not None and getattr(b, p) is not None and torch.equal(getattr(a, p), getattr(b, p)))
        for p in parts
    ) and a.out_features == b.out_features


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and torch.equal(pa[name], pb[name]), name


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny fp32 Qwen2 (fused QKV with a bias), weights only."""
    return make_tiny_model(tmp_path_factory.mktemp("stream"), "qwen2", vocab_size=512)


def test_an_fp32_checkpoint_served_in_bf16_equals_loading_it_whole_then_casting(qwen2_dir) -> None:
    config = load_model_config(qwen2_dir)
    whole = load_model(qwen2_dir, config, torch.float32).to(torch.bfloat16)
    _same_params(load_model(qwen2_dir, config, torch.bfloat16), whole)


def test_a_bf16_checkpoint_reads_straight_into_the_parameters(qwen2_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text((qwen2_dir / "config.json").read_text())
    tensors = load_file(qwen2_dir / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, bf16 / "model.safetensors")
    config = load_model_config(bf16)
    _same_params(load_model(bf16, config, torch.bfloat16), load_model(qwen2_dir, config, torch.float32).bfloat16())


@needs_kernels
def test_codes_found_while_streaming_equal_those_of_the_whole_fp32_model(bundled_model_dir, qwen2_dir) -> None:
    """The keep_codes path (an AVX-512 BF16 CPU's bf16 model from a GGUF conversion), run here at the
    model level: the codes search needs only the fp32 kernel's op."""
    for folder in (bundled_model_dir, qwen2_dir):
        config = load_model_config(folder)
        old = load_model(folder, config, torch.float32)
        old.attach_weight_codes()
        old.to(torch.bfloat16)
        new = load_model(folder, config, torch.bfloat16, fp32_hooks=lambda m: m.codes_hooks())
        _same_params(new, old)
        olds = [m for m in old.model.modules() if isinstance(m, Linear)]
        news = [m for m in new.model.modules() if isinstance(m, Linear)]
        for o, n in zip(olds, news, strict=True):
            assert _same_packed(n.packed_cpu, o.packed_cpu)
            assert (o.bias_fp32 is None) == (n.bias_fp32 is None)
            if o.bias_fp32 is not None:  # the checkpoint's fp32 bias, not the bf16 one widened
                assert n.bias_fp32.dtype == torch.float32 and torch.equal(n.bias_fp32, o.bias_fp32)
        assert _same_packed(new.lm_head_packed_cpu, old.lm_head_packed_cpu)
        if folder == bundled_model_dir:  # the bundled model is all integer blocks: the search found them
            assert all(m.packed_cpu is not None and m.packed_cpu.codes is not None for m in news)


@needs_kernels
def test_fp32_packing_while_streaming_equals_packing_the_loaded_model(bundled_model_dir, qwen2_dir) -> None:
    for folder in (bundled_model_dir, qwen2_dir):
        config = load_model_config(folder)
        old = load_model(folder, config, torch.float32)
        old.pack_linears_cpu()
        new = load_model(folder, config, torch.float32, fp32_hooks=lambda m: m.pack_hooks())
        olds = [m for m in old.model.modules() if isinstance(m, Linear)] + [old.lm_head]
        news = [m for m in new.model.modules() if isinstance(m, Linear)] + [new.lm_head]
        for o, n in zip(olds, news, strict=True):
            if o is None:
                assert n is None
                continue
            assert _same_packed(n.packed_cpu, o.packed_cpu)
            assert (n.weight is None) == (o.weight is None)
            if o.weight is not None:
                assert torch.equal(n.weight, o.weight)
        assert _same_packed(new.lm_head_packed_cpu, old.lm_head_packed_cpu)
        assert (new.model.embed_tokens.weight is None) == (old.model.embed_tokens.weight is None)
        if folder == bundled_model_dir:  # codes stand for every projection: no fp32 copy left
            assert all(n.weight is None for n in news if n is not None)


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_the_load_peak_stays_within_final_weights_plus_largest_tensor_plus_margin(tmp_path, stored) -> None:
    """Measured in a fresh process (bench/load_peak.py: VmHWM after resetting it, so the peak is the
    kernel's exact one). The "small" model's fp32 file (168 MB) is larger than its largest tensor plus
    the margin, so loading that held the file mapped or a whole fp32 copy besides the bf16 weights
    (what the loader did before) breaks the bound: measured 1787 MB against a 792 MB bound on the
    300M model (docs/engine.md)."""
    folder = tmp_path / stored
    load_peak.write_checkpoint(folder, "small", stored)
    r = load_peak.measure(folder, "bfloat16")
    bound = load_memory.load_peak_bound_bytes(r["final_weights_bytes"], r["largest_tensor_bytes"])
    checkpoint = r["checkpoint_bytes"]
    assert r["final_weights_bytes"] >= checkpoint // (2 if stored == "float32" else 1)  # every weight in bf16
    assert r["peak_delta_bytes"] <= bound, load_peak.report(r)
