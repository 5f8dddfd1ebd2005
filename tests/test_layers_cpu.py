"""The fused C++ CPU layers (kernels/csrc/cpu_layers.cpp) and oneDNN-prepacked linears against the
transformers formulas they replace, written out here in plain torch ops."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model
from tokenmill.engine.layers.activation import silu_and_mul
from tokenmill.engine.layers.cpu_gemm_policy import can_prepack
from tokenmill.engine.layers.layernorm import RMSNorm
from tokenmill.engine.layers.linear import Linear, prepack_weight
from tokenmill.engine.layers.rotary_embedding import RotaryEmbedding
from tokenmill.engine.model.loader import load_model
from tokenmill.engine.model_config import load_model_config
from tokenmill.kernels import cpu

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops():
    loaded = cpu.load()
    assert loaded is not None, f"C++ CPU kernels failed to build: {cpu.unavailable_reason()}"
    return loaded


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def float64_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hf_rms_norm's two roundings (the normalised value to x's dtype, then the weight product) on float64
    statistics: the exact answer a kernel and transformers each approximate."""
    h = x.double()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.double() * normed.double()).to(x.dtype)


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((sin, sin), dim=-1)
    return (x * cos) + (rotated * sin)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the dtype's last place (relative to b)."""
    eps = torch.finfo(a.dtype).eps
    scale = b.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
    return int(((a.float() - b.float()).abs() / (scale * eps)).ceil().max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_transformers(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(37, 576, generator=g).to(dtype)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    expected_sum = x + residual
    expected = hf_rms_norm(expected_sum, norm.weight, 1e-5)
    out, new_residual = norm(x.clone(), residual)
    assert torch.equal(new_residual, expected_sum)  # the residual stream is rounded exactly as transformers
    # fp32 statistics summed in another order than torch's, whose order depends on the ISA ATen runs at
    # (seeds 0-19, 576 wide: kernel vs transformers up to 4 fp32 ulps at the avx2 tier, 3 at generic;
    # each of them up to 3 from float64). So the bar is the float64 computation with the same two
    # roundings: the kernel is at most one ulp further from it than transformers is on this CPU.
    exact = float64_rms_norm(expected_sum, norm.weight, 1e-5)
    bar = max(ulps_apart(expected, exact), 1) + 1
    assert ulps_apart(out, exact) <= bar
    assert ulps_apart(norm(expected_sum), exact) <= bar


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_fused_qkv_matches_transformers(ops, dtype):
    g = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, tokens = 9, 3, 64, 11
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 7, 511, 8, 9, 300])
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    cos, sin = rope.cos_sin(positions, dtype)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(tokens, num_heads + num_kv_heads, head_dim)
    expected = hf_rotary(qk, cos, sin)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    rope.for_positions(positions, dtype).apply(qk)
    assert torch.equal(qk, expected)  # every product and sum rounded where transformers rounds it
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


def test_rotary_position_outside_table_is_an_error(ops):
    rope = RotaryEmbedding(64, 16, 10000.0, None)
    x = torch.randn(2, 1, 64)
    with pytest.raises(RuntimeError, match=r"position 16 outside the rotary table \[0, 16\)"):
        rope.for_positions(torch.tensor([3, 16]), torch.float32).apply(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_transformers(ops, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(13, 2 * 1536 + 2 * 5, generator=g) * 4).to(dtype)  # a width that leaves a scalar tail
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, -0.5]).to(dtype)
    d = x.shape[1] // 2
    expected = F.silu(x[:, :d]) * x[:, d:]
    out = silu_and_mul(x)
    if dtype == torch.float32:
        assert ulps_apart(out, expected) <= 2  # a polynomial exp, ~1 ulp from torch's
    else:
        assert torch.equal(out, expected)  # silu rounded to the dtype, then the product


def test_prepacked_linear_is_bit_identical():
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        # This CPU cannot run oneDNN's bf16 reorder (no AVX-512): the probe must agree with oneDNN,
        # and bf16 linears then run unpacked.
        with pytest.raises(RuntimeError, match="bf16"):
            prepack_weight(torch.zeros(64, 64, dtype=torch.bfloat16))
        lin = Linear(64, 32).to(torch.bfloat16)
        assert lin(torch.ones(3, 64, dtype=torch.bfloat16)).shape == (3, 32)
        return
    g = torch.Generator().manual_seed(3)
    lin = Linear(576, 960, bias=True).to(torch.bfloat16)
    for rows in (1, 3, 64, 300):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        plain = lin(x)
        lin.prepack()
        assert torch.equal(lin(x), plain)
        lin.packed = None


def test_prepacked_model_gives_the_same_logits(tmp_path, bundled_model_dir):
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU cannot run oneDNN's bf16 reorder (test_prepacked_linear_is_bit_identical checks that)")
    model_dir = make_tiny_model(tmp_path, "llama", tokenizer_dir=bundled_model_dir)
    config = load_model_config(model_dir)
    model = load_model(model_dir, config, torch.bfloat16, "cpu")
    hidden = torch.randn(5, config.hidden_size).to(torch.bfloat16)
    x = torch.randn(5, config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        before = (model.compute_logits(hidden), model.model.layers[0].mlp(x))
        model.prepack_linears(dense=False)  # oneDNN's layout (the dense bf16 panels: test_linear_dense_bf16.py)
        after = (model.compute_logits(hidden), model.model.layers[0].mlp(x))
    assert model.model.layers[0].mlp.down_proj.packed is not None and model.lm_head_packed is not None
    assert model.lm_head is not None and model.lm_head.packed is None  # one packed copy of the LM head
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
