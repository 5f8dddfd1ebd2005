"""engine/bench/quant_model.py's Q4_K_M mix: which tensors of a 16-layer model get Q6_K (llama.cpp's rule
for that file type, worked out by hand here: layers 0-1 and 14-15, and 4, 7, 10, 13 between)."""

from tokenmill.engine.bench.quant_model import tensor_type


def test_the_q4_k_m_mix_puts_q6_k_where_llama_cpp_does() -> None:
    six = {i for i in range(16) if tensor_type(f"blk.{i}.ffn_down.weight", "Q4_K_M", 16) == "Q6_K"}
    assert six == {0, 1, 4, 7, 10, 13, 14, 15}
    assert {i for i in range(16) if tensor_type(f"blk.{i}.attn_v.weight", "Q4_K_M", 16) == "Q6_K"} == six
    assert tensor_type("token_embd.weight", "Q4_K_M", 16) == "Q6_K"  # tied: the output too
    for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert {tensor_type(f"blk.{i}.{name}.weight", "Q4_K_M", 16) for i in range(16)} == {"Q4_K"}
    assert tensor_type("blk.0.ffn_down.weight", "Q5_K", 16) == "Q5_K"  # a plain type applies everywhere
