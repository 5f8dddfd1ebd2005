"""One count of a quantized model's weights (engine/quant_memory.py) for the engine's plan, `serve --check`
and the operator's sizing: AWQ / GPTQ hub models are sized from their shape (the Hub's safetensors count
holds packed int32 words), GGUF files from their header, and the counts equal what the loaders build."""

import copy
import json

import pytest
import torch
from tokenmill.engine import quant_memory
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.gguf_header import read_gguf_header
from tokenmill.engine.worker.engine_plan import model_weights, plan_engine
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels.cpu_probe import probe
from tokenmill.operator.plan.catalog import GPU_TYPES, MODEL_PROFILES, profile_from_hf_config
from tokenmill.operator.plan.sizing import EngineSettings, plan

from tests.test_operator_catalog import LLAMA_31_8B_CONFIG

AWQ = {**LLAMA_31_8B_CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                     "zero_point": True, "version": "gemm"}}  # fmt: skip


def test_an_awq_hub_model_is_sized_by_its_shape_not_its_packed_tensor_count(tmp_path) -> None:
    # The Hub's safetensors metadata counts an AWQ 8B's int32 words: ~1.05e9 "parameters" (I32 + F16).
    packed_count = 1_050_000_000
    profile = profile_from_hf_config(AWQ, "llama-awq", num_parameters=packed_count, source="hub")
    assert profile.quantization == "awq-g128"
    assert profile.num_parameters == MODEL_PROFILES["Llama-3.1-8B"].num_parameters  # from the shape
    p = plan(profile, GPU_TYPES["nvidia-l4"], EngineSettings())
    # On a GPU the engine dequantizes int4 weights at load (no GPU codes kernels yet): bf16 bytes.
    assert p.weights_bytes == 2 * profile.num_parameters
    # The engine's own plan of the same config.json on that device says the same.
    (tmp_path / "config.json").write_text(json.dumps(AWQ))
    assert model_weights(tmp_path, "cuda", "bfloat16", 1).loaded_bytes == p.weights_bytes
    # On a CPU serving fp32 it keeps the codes: 4-bit projections with per-32 zeros, per-128 fp16 scales.
    projections = 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)
    others = profile.num_parameters - projections
    # The fp16 LM head: fp32 panels for the fp32 kernel beside the fp32 matrix torch's GEMM reads.
    lm_head = AWQ["vocab_size"] * AWQ["hidden_size"]
    fp32 = model_weights(tmp_path, "cpu", "float32", 1).loaded_bytes
    if probe().at_least("avx2"):  # the CPU kernels run
        assert fp32 == others * 4 + lm_head * 4 + projections * 19 // 32  # 0.5 + 2/32 (sc, mn) + 4/128 (d, dmin)
    else:
        assert fp32 == 4 * profile.num_parameters
    # Serving bf16 it keeps them where the CPU has the bf16 codes kernels (the probe's answer), else it
    # holds bf16 weights as a GPU does.
    cpu = model_weights(tmp_path, "cpu", "bfloat16", 1).loaded_bytes
    if quant_memory.codes_held("cpu", "bfloat16", 1, probe().at_least("avx512_bf16")):
        assert cpu < p.weights_bytes / 2.5
    else:
        assert cpu == p.weights_bytes


def test_serve_check_counts_a_gguf_from_its_header(tmp_path) -> None:
    from tokenmill.engine.model.bundled import bundled_gguf_path

    plan_ = plan_engine(EngineConfig(dtype="float32", device="cpu"))
    header = read_gguf_header(bundled_gguf_path())
    codes = probe().at_least("avx2")  # where the CPU kernels run, the Q4_1 / Q8_0 blocks stay codes
    assert plan_.weights.loaded_bytes == quant_memory.gguf_weights(header.tensors, "float32", codes).loaded_bytes
    assert (plan_.weights.loaded_bytes < plan_.weights.parameters) == codes
    assert plan_.weights.file_bytes == sum(t.nbytes for t in header.tensors)
    assert plan_.weights.parameters == 134_515_008


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C++ CPU kernels")
def test_the_count_is_what_the_loaders_build(tmp_path) -> None:
    """quant_memory's bytes equal the bytes of the codes and tensors a loaded model holds: a GGUF mixing
    every type, an AWQ checkpoint (its config-only count), and unquantized checkpoints stored in bf16 and
    fp32, loaded and packed as the worker does (load_peak's child) for an fp32 model."""
    from tokenmill.engine.bench.load_peak import _resident_weight_bytes, measure
    from tokenmill.engine.model.loader import load_model
    from tokenmill.engine.model.resolve import resolve_model
    from tokenmill.engine.model_config import load_model_config

    from tests.int4_checkpoints import write_int4
    from tests.test_gguf_direct import TYPES
    from tests.test_model_gguf import TINY_VOCAB, write_gguf
    from tests.tiny_models import make_tiny_model

    hf = make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512)
    folder = resolve_model(write_gguf(tmp_path / "q.gguf", hf, "llama", types=TYPES))
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(folder, load_model_config(folder), dtype, "cpu")
        name = str(dtype).removeprefix("torch.")
        assert model_weights(folder, "cpu", name, 1).loaded_bytes == _resident_weight_bytes(model), name
    write_int4(hf, tmp_path / "awq", tmp_path / "ref", "awq")
    folders = [tmp_path / "awq", hf, make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB, hidden_size=256,
                                                      intermediate_size=512, dtype=torch.bfloat16)]  # fmt: skip
    held = {f.name: measure(f, "float32")["final_weights_bytes"] for f in folders}
    for f in folders:
        assert model_weights(f, "cpu", "float32", 1).loaded_bytes == held[f.name], f.name
    # A bf16 checkpoint's panels are bf16 with no fp32 copy: under a third of the fp32 checkpoint's
    # (panels and the matrix); without the kernels both are plain fp32 tensors.
    if probe().at_least("avx2"):
        assert held[folders[2].name] < held[hf.name] / 3
    else:
        assert held[folders[2].name] == held[hf.name]


def test_plans_that_do_not_fit_the_machine_are_refused() -> None:
    with pytest.raises(ValueError, match=r"the model's weights take .* GiB as held in float32 .* and the KV pool "
                                         r".* GiB, more than the .* GiB this process may use"):  # fmt: skip
        plan_engine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=1 << 50))


def test_unquantized_profiles_size_as_before() -> None:
    cfg = copy.deepcopy(LLAMA_31_8B_CONFIG)
    p = profile_from_hf_config(cfg, "llama", num_parameters=8_030_261_248)
    assert p.quantization == "" and plan(p, GPU_TYPES["nvidia-l4"]).weights_bytes == 2 * 8_030_261_248
