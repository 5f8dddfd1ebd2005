"""Roofline arithmetic by hand, and the model shape read from the bundled model's files."""

import pytest
import torch
from tokenmill.engine.bench.roofline import copy_bandwidth, decode_step_cost, matmul_flops, roofline_fraction

SHAPE = {"params": 1000, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}


def test_decode_step_cost_by_hand():
    flops, nbytes = decode_step_cost(SHAPE, batch=3, context=10, dtype="bfloat16")
    # 2 FLOPs per weight per token, plus QK^T and PV: 4 * batch * context * heads * head_dim * layers
    assert flops == 2 * 1000 * 3 + 4 * 3 * 10 * 4 * 8 * 2
    # weights once (2 bytes each) + KV: K and V, 2 layers, 2 kv heads, 8 dims, 2 bytes, per cached token
    assert nbytes == 1000 * 2 + 3 * 10 * (2 * 2 * 2 * 8 * 2)


def test_roofline_fraction_by_hand():
    # 1e9 FLOPs at 1e11 FLOP/s = 10 ms; 1e8 bytes at 1e10 B/s = 10 ms; 5e8 bytes would be 50 ms.
    r = roofline_fraction(flops=1e9, nbytes=5e8, seconds=0.1, peak_flops=1e11, bandwidth=1e10)
    assert r["bound_by"] == "memory"
    assert r["roofline_ms"] == pytest.approx(50)
    assert r["fraction_of_roofline"] == pytest.approx(0.5)
    assert r["achieved_gflops"] == pytest.approx(10)
    r = roofline_fraction(flops=4e9, nbytes=1e8, seconds=0.08, peak_flops=1e11, bandwidth=1e10)
    assert r["bound_by"] == "compute" and r["fraction_of_roofline"] == pytest.approx(0.5)


def test_machine_measurements_are_positive_and_sane():
    torch.set_num_threads(1)
    flops = matmul_flops(torch.float32, n=256, reps=2)
    assert 1e8 < flops < 1e13
    bw = copy_bandwidth(megabytes=32, reps=2)
    assert 1e8 < bw < 1e12


def test_model_shape_of_the_bundled_model():
    from tokenmill.engine.bench.roofline import model_shape
    from tokenmill.engine.model.resolve import resolve_model

    shape = model_shape(str(resolve_model(None)))
    # SmolLM2-135M: the published parameter count and attention shape; its GGUF's weights as codes: 30 layers
    # of Q4_1 projections (576 x (576 + 192 + 192 + 576) + 3 x 1536 x 576 each) at 0.5 + 4 / 32 bytes (a
    # nibble, an fp16 scale and min per 32), the Q8_0 embedding at 1 + 4 / 32, 61 norms of 576 in bf16
    weights = shape.pop("weight_bytes")
    assert shape == {"params": 134_515_008, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    projections = 30 * (576 * (576 + 192 + 192 + 576) + 3 * 1536 * 576)
    assert weights == projections * 5 // 8 + 49152 * 576 * 9 // 8 + 61 * 576 * 2


def test_a_bf16_checkpoint_served_in_fp32_is_read_at_its_panels_bytes(tmp_path):
    """On the fp32 kernel a bf16 checkpoint's linears are bf16 panels: a step reads 2 bytes per linear
    weight, not fp32's 4 (norms stay fp32); without the kernels, the fp32 weights."""
    import torch
    from tokenmill.engine.bench.roofline import model_shape
    from tokenmill.kernels.cpu_probe import probe

    from tests.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama", vocab_size=1000, hidden_size=256, intermediate_size=512,
                             dtype=torch.bfloat16)  # fmt: skip
    fp32 = model_shape(str(folder), "float32")
    assert "weight_bytes" not in model_shape(str(folder), "bfloat16")  # params x 2
    if probe().at_least("avx2"):
        # Its untied embedding (a quarter of a million of the 1.7 million weights) stays an fp32 table.
        assert 2 * fp32["params"] < fp32["weight_bytes"] < 0.6 * 4 * fp32["params"]
    else:
        assert "weight_bytes" not in fp32
