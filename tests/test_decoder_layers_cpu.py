"""engine/models/llama_cpu_decoder.py: a bf16 step's layers after the first in one C++ call give the Python layer loop's
tokens and logprobs bit for bit, on the bundled model, at batch sizes that take each linear kernel."""

import pytest
import torch
from tokenmill.engine import LLM, SamplingParams
from tokenmill.engine.layers.cpu_gemm_policy import bf16_codes_max_rows, bf16_codes_wanted, bf16_dot_supported
from tokenmill.engine.models import llama_cpu_decoder

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _loop_expected() -> bool:
    """The C++ loop runs the codes kernels, which need the avx512_bf16 tier (and the kernels built)."""
    return bf16_codes_wanted(CPU, torch.bfloat16) and bf16_dot_supported()


@pytest.fixture(scope="module")
def llm_bf16():
    # Where the CPU has the codes kernels the loop must be on; elsewhere the test checks the Python path.
    assert llama_cpu_decoder.fused_layers_enabled() == _loop_expected()
    return LLM(dtype="bfloat16", max_model_len=256, max_num_seqs=48, num_kv_blocks=160, enable_prefix_caching=False)


def _generate(llm, prompts, fused: bool, monkeypatch) -> tuple[list, list[int]]:
    calls = []
    run = llama_cpu_decoder.run_layers

    def counting(*args, **kwargs):
        calls.append(args[2].shape[0])
        return run(*args, **kwargs)

    monkeypatch.setattr(llama_cpu_decoder, "run_layers", counting)
    if not fused:
        monkeypatch.setattr(llama_cpu_decoder, "step_fits", lambda hidden, rope, md: False)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    monkeypatch.undo()
    got = [(o.outputs[0].token_ids, [dict(lp) for lp in o.outputs[0].logprobs]) for o in outs]
    return got, calls


# 1 row: the dot kernel; 6 rows: the AMX codes kernel where the CPU has AMX; 40: the AMX dequant kernel
# there, and past the dot kernel's rows without AMX (bf16_codes_max_rows: then the Python loop runs).
@pytest.mark.parametrize("batch", [1, 6, 40])
def test_fused_layers_give_the_python_loops_tokens_and_logprobs(llm_bf16, batch, monkeypatch) -> None:
    g = torch.Generator().manual_seed(batch)
    # short prompts, so the prompt steps (under 128 rows) take the C++ loop too when batch is small
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (batch,), generator=g)]
    got, calls = _generate(llm_bf16, prompts, True, monkeypatch)
    max_rows = bf16_codes_max_rows()
    assert all(rows <= max_rows for rows in calls)  # no step past the codes kernels' rows took the loop
    if _loop_expected() and batch <= max_rows:
        assert batch in calls  # the decode steps went through the C++ loop
    elif not _loop_expected():
        assert not calls
    if calls:  # some steps took the loop: the Python loop alone must give the same (with no loop calls)
        want, none = _generate(llm_bf16, prompts, False, monkeypatch)
        assert not none
        assert got == want
