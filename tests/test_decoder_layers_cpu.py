"""engine/models/llama_cpu_decoder.py: a step's layers after the first in one C++ call give the Python layer loop's
tokens and logprobs bit for bit, on the bundled model, at batch sizes that take each linear kernel: in bf16 from
its integer codes (the GGUF conversion) and from dense bf16 panels (the same model stored in bf16); in fp32
(the dtype below AVX-512 BF16) from the codes and from the fp32 kernel's bf16 panels of the bf16 checkpoint."""

import pytest
import torch
from tokenmill.engine import LLM, SamplingParams
from tokenmill.engine.layers.cpu_gemm_policy import (
    bf16_codes_max_rows,
    bf16_codes_wanted,
    bf16_dot_supported,
    dense_bf16_max_rows,
    dense_bf16_supported,
)
from tokenmill.engine.layers.linear import Linear
from tokenmill.engine.models import llama_cpu_decoder

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _loop_expected() -> bool:
    """The C++ loop runs the codes kernels, which need the avx512_bf16 tier (and the kernels built)."""
    return bf16_codes_wanted(CPU, torch.bfloat16) and bf16_dot_supported()


@pytest.fixture(scope="module", params=["codes", "codes-int8-activations"])
def llm_bf16(request):
    """The bundled model in bf16 from its integer codes; also with int8 activations, whose kernel (on AVX-512
    VNNI CPUs; elsewhere the flag has no effect in bf16) the loop calls as the Python path does."""
    # Where the CPU has the codes kernels the loop must be on; elsewhere the test checks the Python path.
    assert llama_cpu_decoder.fused_layers_enabled(torch.bfloat16) == _loop_expected()
    return LLM(dtype="bfloat16", max_model_len=256, max_num_seqs=48, num_kv_blocks=160, enable_prefix_caching=False,
               int8_activations=request.param == "codes-int8-activations")


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
# there, and past the dot kernel's rows without AMX: the dense kernel on rebuilt codes or the fp32-FMA GEMM
# (bf16_codes_max_rows: where neither runs, the Python loop).
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


@pytest.fixture(scope="module")
def llm_dense(bundled_checkpoint):
    """The bundled model stored in bf16: no integer codes, so every projection runs on dense bf16 panels
    where the CPU has AVX-512 BF16 (oneDNN's prepacked weights elsewhere)."""
    return LLM(model=str(bundled_checkpoint("bfloat16")), dtype="bfloat16", max_model_len=256, max_num_seqs=48,
               num_kv_blocks=160, enable_prefix_caching=False)


# 1 row and 6: decode tiles of 1 and 6 rows; 40 rows: past the codes kernels' 32 on AVX-512 BF16 without
# AMX, where the dense kernel still takes the step (and on AMX, oneDNN from DENSE_AMX_MIN_ROWS: Python loop).
@pytest.mark.parametrize("batch", [1, 6, 40])
def test_fused_layers_on_dense_bf16_give_the_python_loops_tokens_and_logprobs(llm_dense, batch, monkeypatch) -> None:
    model = llm_dense.engine.core.executor.worker.runner.model
    linears = [m for m in model.model.modules() if isinstance(m, Linear)]
    dense = dense_bf16_supported() and llama_cpu_decoder.fused_layers_enabled(torch.bfloat16)
    assert all((m.packed_cpu is not None and m.packed_cpu.dense is not None) == dense_bf16_supported() for m in linears)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (batch,), generator=g)]
    got, calls = _generate(llm_dense, prompts, True, monkeypatch)
    assert all(rows <= dense_bf16_max_rows() for rows in calls)
    if dense and batch <= dense_bf16_max_rows():
        assert batch in calls
    elif not dense:
        assert not calls
    if calls:
        want, none = _generate(llm_dense, prompts, False, monkeypatch)
        assert not none
        assert got == want


@pytest.fixture(scope="module", params=["gguf", "gguf-int8-activations", "bf16-checkpoint"])
def llm_fp32(request, bundled_checkpoint):
    """The bundled model served in fp32: its GGUF (integer codes; also with int8 activations, whose kernel
    the loop calls as the Python path does) or its bf16 checkpoint (bf16 panels)."""
    model = None if request.param.startswith("gguf") else str(bundled_checkpoint("bfloat16"))
    return LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=48, num_kv_blocks=160,
               enable_prefix_caching=False, int8_activations=request.param == "gguf-int8-activations")


# 1 and 6 rows: the codes' and panels' tile kernels; 40 rows: past CPU_PACKED_MAX_ROWS, where codes take the
# cache-blocked GEMM (cpu_gemm.cpp) inside the loop too, since no fp32 copy is kept for torch's linear.
@pytest.mark.parametrize("batch", [1, 6, 40])
def test_fused_layers_in_fp32_give_the_python_loops_tokens_and_logprobs(llm_fp32, batch, monkeypatch) -> None:
    model = llm_fp32.engine.core.executor.worker.runner.model
    linears = [m for layer in model.model.layers[1:] for m in layer.modules() if isinstance(m, Linear)]
    # The loop runs where every projection holds the CPU kernels' weights alone (codes or panels, no fp32
    # copy): what the capability probe gives this machine, read from the loaded model.
    alone = all(m.packed_cpu is not None and m.packed_cpu.stands_alone and m.weight is None for m in linears)
    expected = llama_cpu_decoder.fused_layers_enabled(torch.float32) and alone
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (batch,), generator=g)]
    got, calls = _generate(llm_fp32, prompts, True, monkeypatch)
    assert (batch in calls) == expected, calls  # the decode steps went through the C++ loop, or none did
    if calls:
        want, none = _generate(llm_fp32, prompts, False, monkeypatch)
        assert not none
        assert got == want
