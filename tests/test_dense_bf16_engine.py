"""The engine on dense bf16 weights (a checkpoint stored in bf16, served in bf16): where the CPU has AVX-512
BF16 every projection and the LM head run on the dense bf16 kernel's panels (kernels/csrc/cpu_dense_bf16.cpp)
and keep no other copy of their weights. Parity: bf16 rounds every activation, so greedy tokens part from
fp32's at near-ties (one such on these prompts at token 10); as in test_half_checkpoints.py, every prefix
of a text is teacher-forced and the engine's next-token choices must agree with the fp32 engine's (which
are transformers' in fp32) as often as transformers' own bf16 forward does, with a mean logprob error
within 1.5x of its. Elsewhere the same checks run on oneDNN's or torch's bf16 linears.
"""

import pytest
import torch
from tokenmill.engine import LLM
from tokenmill.engine.layers.cpu_gemm_policy import dense_bf16_max_rows, dense_bf16_supported
from tokenmill.engine.layers.linear import Linear

from tests.test_engine_generate import MAX_TOKENS, PROMPTS, run_tokens
from tests.test_half_checkpoints import TEXT, _engine_next, half_agreement
from tests.tiny_models import make_tiny_model


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.executor.worker.runner.model


# llama: a separate LM head; qwen2: q/k/v biases (the kernel adds the fp32 bias); llama3_rope: a tied
# embedding, whose rows come from the LM head's panels.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3_rope"])
def test_tiny_bf16_checkpoint_served_in_bf16_agrees_with_the_fp32_engine_as_transformers_does(
        tmp_path, bundled_model_dir, arch) -> None:
    model_dir = make_tiny_model(tmp_path, arch, tokenizer_dir=bundled_model_dir, dtype=torch.bfloat16)
    kw = dict(model=str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=11)
    fp32 = LLM(dtype="float32", **kw)
    text_ids = fp32.get_tokenizer().encode(TEXT)
    prefixes = [text_ids[:n] for n in range(4, len(text_ids))]
    want = _engine_next(fp32, prefixes)
    ids = [fp32.engine.tokenize(p) for p in PROMPTS]
    del fp32
    llm = LLM(dtype="bfloat16", **kw)
    model = _model(llm)
    linears = [m for m in model.model.modules() if isinstance(m, Linear)]
    if dense_bf16_supported():
        one_copy = dense_bf16_max_rows() >= 1 << 62  # below AMX: no oneDNN copy beside the panels
        assert all(m.packed_cpu.dense is not None and m.weight is None for m in linears)
        assert all((m.packed is None) == one_copy for m in linears)
        assert model.lm_head_packed_cpu is not None and model.lm_head_packed_cpu.dense is not None
        if arch == "llama3_rope":  # tied: the embedding reads the LM head's panels
            assert model.model.embed_tokens.weight is None and model.model.embed_tokens.packed_cpu is not None
    else:
        assert all(m.packed_cpu is None for m in linears)
    got = _engine_next(llm, prefixes)
    hf_top1, hf_diff, our_top1, our_mean = half_agreement(model_dir, text_ids, torch.bfloat16, prefixes, want, got)
    hf_mean = sum(hf_diff) / len(hf_diff)
    print(f"\n{arch}: top-1 vs fp32 at {our_top1} of {len(prefixes)} (transformers bf16 {hf_top1}); "
          f"mean |logprob diff| {our_mean:.4f} (transformers {hf_mean:.4f})")
    assert our_top1 >= hf_top1 - 1 and our_mean <= 1.5 * hf_mean
    # Free-running through chunked prompts (max_num_batched_tokens=11: steps of 1 to 11 rows, mixed
    # prefill and decode) to the end, every KV block returned.
    outs = run_tokens(llm, ids)
    assert [len(o) for o in outs] == [MAX_TOKENS] * len(PROMPTS)


# llama: a separate LM head and an untied fp32 embedding table; llama3_rope: a tied embedding, whose rows
# then come from the LM head's bf16 panels.
@pytest.mark.parametrize("arch", ["llama", "llama3_rope"])
def test_tiny_bf16_checkpoint_served_in_fp32_matches_transformers_on_bf16_panels(
        tmp_path, bundled_model_dir, arch) -> None:
    """Served in fp32 (the default where the CPU lacks AVX-512 BF16), a bf16 checkpoint's weights are bf16
    values: the fp32 kernel keeps them as bf16 panels (half the bytes) and no fp32 copy, and the tokens are
    transformers' in fp32, token for token, through steps of up to 64 rows (past the small-batch tiles)."""
    from tokenmill.engine.layers.cpu_gemm_policy import fp32_linear_ops

    from tests.test_engine_generate import hf_greedy

    model_dir = make_tiny_model(tmp_path, arch, tokenizer_dir=bundled_model_dir, dtype=torch.bfloat16)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)
    model = _model(llm)
    linears = [m for m in model.model.modules() if isinstance(m, Linear)]
    if fp32_linear_ops(torch.device("cpu"), torch.float32) is not None:
        assert all(m.packed_cpu.fp32.dtype == torch.bfloat16 and m.weight is None for m in linears)
        assert model.lm_head_packed_cpu.fp32.dtype == torch.bfloat16
        embed = model.model.embed_tokens
        assert (embed.weight is None) == (arch == "llama3_rope")  # tied: rows from the LM head's panels
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    assert run_tokens(llm, ids) == hf_greedy(model_dir, ids, MAX_TOKENS)
