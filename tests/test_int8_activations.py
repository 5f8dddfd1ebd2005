"""--int8-activations through the engine: the flag, which weights take it, and greedy parity of the bundled
model served in fp32 with its activations rounded to int8 per 32 (kernels/csrc/cpu_codes_int8.cpp) against
the exact fp32 engine (engine/bench/kv_cache.py's greedy_parity: vLLM's check_logprobs_close criterion):
its Q4_1 GGUF (the codes layout) and an AWQ int4 checkpoint of the same weights (the grouped layout).

The tolerances (docs/engine.md, "int8 activations", has the measurement they rest on): at every step where
both runs have the same context, the chosen token's logprob within MAX_LOGPROB_DIFF nats and on average
within MEAN_LOGPROB_DIFF; where greedy tokens part, each run's token is in the other's top 5. The kernel's
arithmetic is the same on every CPU with AVX2 (integer sums exact, the fp32 part in one order), so these
figures do not depend on the machine.
"""

import pytest
import torch
from tokenmill.engine import LLM
from tokenmill.engine.bench.kv_cache import PARITY_PROMPTS, generate_greedy, greedy_parity
from tokenmill.engine.cli.serve import engine_config, parse_args
from tokenmill.engine.layers.cpu_gemm_policy import fp32_linear_ops, int8x_bf16_supported
from tokenmill.engine.layers.linear import CpuPackedWeight
from tokenmill.kernels.cpu_probe import needs

# nats. 16 prompts x 32 tokens on the AVX2 EPYC (2026-12-06): max 0.31, mean 0.048 over 64 tokens.
MAX_LOGPROB_DIFF = 0.5
MEAN_LOGPROB_DIFF = 0.08
TOKENS = 32

pytestmark = pytest.mark.skipif(
    fp32_linear_ops(torch.device("cpu"), torch.float32) is None, reason=f"{needs('avx2')} (or the kernels did not build)"
)


def test_the_serve_flag_reaches_the_engine_config():
    assert engine_config(parse_args(["--int8-activations"])).int8_activations is True
    assert engine_config(parse_args([])).int8_activations is False


def _packed(llm: LLM) -> list[CpuPackedWeight]:
    model = llm.engine.core.executor.worker.runner.model
    found = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, CpuPackedWeight)}
    return list(found.values())


@pytest.fixture(scope="module")
def runs():
    exact = LLM(dtype="float32", max_model_len=256, num_kv_blocks=256)
    int8 = LLM(dtype="float32", max_model_len=256, num_kv_blocks=256, int8_activations=True)
    return exact, int8


def test_every_codes_weight_and_only_those_take_int8_activations(runs):
    exact, int8 = runs
    assert not any(p.int8_x for p in _packed(exact))
    weights = _packed(int8)
    codes = [p for p in weights if p.codes is not None]
    # the bundled GGUF: 30 layers x (q|k|v, o, gate|up, down) in Q4_1 and the tied Q8_0 head
    assert len(codes) >= 30 * 4 + 1
    assert all(p.int8_x == (p.codes is not None) for p in weights)


def _assert_parity(exact: LLM, int8: LLM, max_diff: float, mean_diff: float) -> None:
    prompts = PARITY_PROMPTS[:16]
    p = greedy_parity(generate_greedy(exact, prompts, TOKENS), generate_greedy(int8, prompts, TOKENS))
    assert p.compared_steps >= 16 * 4
    assert p.max_abs_logprob_diff <= max_diff, p
    assert p.mean_abs_logprob_diff <= mean_diff, p
    assert p.divergent_in_top_k, p
    assert p.mean_abs_logprob_diff > 0.0  # the mode is on: the exact kernels would give 0 here


def test_greedy_parity_with_the_exact_fp32_engine(runs):
    _assert_parity(*runs, MAX_LOGPROB_DIFF, MEAN_LOGPROB_DIFF)


# The bundled model served in bf16 (its codes with fp16 scales) with int8 activations, on the kernel's VNNI
# tiles, at every batch size (prompts too), against the same exact fp32 engine. Measured 16 prompts x 32
# tokens on the AVX-512 BF16 EPYC (2026-12-07): max 0.372, mean 0.056 nats (bf16 without the flag: max
# 0.107, mean 0.015; fp32 with it: max 0.369, mean 0.058): within the fp32 mode's bounds.
@pytest.mark.skipif(not int8x_bf16_supported(), reason="needs a CPU with AVX-512 VNNI and VBMI (the kernels' VNNI tiles)")
def test_bf16_model_takes_int8_activations_within_the_same_tolerance(runs):
    exact, _ = runs
    int8 = LLM(dtype="bfloat16", max_model_len=256, num_kv_blocks=256, int8_activations=True)
    weights = _packed(int8)
    codes = [p for p in weights if p.codes is not None]
    assert len(codes) >= 30 * 4 + 1 and all(p.int8_x == (p.codes is not None) for p in weights)
    assert any(p.scales.dtype == torch.float16 for p in codes)  # the bf16 kernels' layout, not the fp32 one
    _assert_parity(exact, int8, MAX_LOGPROB_DIFF, MEAN_LOGPROB_DIFF)


def test_bench_peers_serves_tokenmill_int8_with_the_flag_the_server_parses():
    from tokenmill.engine.bench.peers import PeerModel, server_command, weights_read
    from tokenmill.engine.model.bundled import bundled_gguf_path

    gguf = str(bundled_gguf_path())
    model = PeerModel("bundled", "", gguf, gguf)
    for engine, want in (("tokenmill", False), ("tokenmill-int8", True)):
        cmd = server_command(engine, 18700, model, "", "")
        assert cmd[3] == "serve"
        assert engine_config(parse_args(cmd[4:])).int8_activations is want
    # the table names the mode where the server's log says the worker took it
    log = "INFO worker: int8 activations: 121 integer-code weights round x to int8 per 32 values"
    assert weights_read("tokenmill-int8", model, log).format.endswith(", int8 activations")
    assert not weights_read("tokenmill-int8", model, "").format.endswith(", int8 activations")


# An AWQ int4 checkpoint of the same weights (group 64: the 576-wide rows hold no 128- or 256-weight group,
# so no Q4_K either), whose linears run the grouped layout's int8 kernel. Measured 16 prompts x 32 tokens on
# the AVX2 EPYC (2026-12-07): 3 / 16 identical, max 0.470, mean 0.066 nats: more than the Q4_1 model's, as
# 4-bit round-to-nearest weights leave the model less margin; bounds with the same headroom over them.
INT4_MAX_LOGPROB_DIFF = 0.75
INT4_MEAN_LOGPROB_DIFF = 0.1


def test_int4_awq_weights_keep_greedy_parity_within_their_tolerance(tmp_path):
    from tokenmill.engine.layers.grouped_codes import GroupedPackedWeight
    from tokenmill.engine.model.bundled import bundled_gguf_path
    from tokenmill.engine.model.gguf_cache import dequantized_copy_cached

    from tests.int4_checkpoints import write_int4

    write_int4(dequantized_copy_cached(bundled_gguf_path()), tmp_path / "int4", tmp_path / "ref", "awq", group=64)
    kw = dict(model=str(tmp_path / "int4"), dtype="float32", max_model_len=256, num_kv_blocks=256)
    exact, int8 = LLM(**kw), LLM(**kw, int8_activations=True)
    model = int8.engine.core.executor.worker.runner.model
    grouped = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, GroupedPackedWeight)}
    assert len(grouped) == 30 * 4 and all(w.int8_x for w in grouped.values())  # q|k|v, o, gate|up, down
    _assert_parity(exact, int8, INT4_MAX_LOGPROB_DIFF, INT4_MEAN_LOGPROB_DIFF)
