"""--kv-cache-dtype through the engine: the flag and its errors, the pool the worker allocates against the
bytes kv_memory counts, and greedy parity of the 8-bit caches with the model's-dtype cache on the bundled
model (engine/bench/kv_cache.py's greedy_parity: vLLM's check_logprobs_close criterion).

The tolerances (docs/engine.md, "8-bit KV cache", has the measurements they rest on): at every step
where both runs have the same context, the chosen token's logprob within MAX_LOGPROB_DIFF nats and on
average within MEAN_LOGPROB_DIFF; where greedy tokens part, each run's token is in the other's top 5.
"""

import pytest
import torch
from tokenmill.engine import LLM, kv_memory
from tokenmill.engine.bench.kv_cache import PARITY_PROMPTS, generate_greedy, greedy_parity
from tokenmill.engine.cli.serve import engine_config, parse_args
from tokenmill.engine.models import llama_cpu_decoder

from tests.tiny_models import make_tiny_model

# nats; int8 rounds each value to 1/254 of its row's absmax, fp8_e4m3 to 3 mantissa bits (1/16 relative).
# The fp8 max is one step's worst case and moves with the order of the attention kernel's sums alone: the
# bf16 model on the same AVX-512 BF16 EPYC gave 0.573, 0.612 and 0.643 (8 x 32) with three summation orders
# of equal accuracy against fp64 (2026-12-07), so its bound leaves room above that spread.
MAX_LOGPROB_DIFF = {"int8": 0.35, "fp8": 0.7}
# The int8 mean: 0.0194 with the codes kernels (AVX-512 BF16 Xeon, 16 x 64), 0.0308 on the AVX2-only EPYC,
# whose bf16 model has no codes kernels and runs bf16-rounded weights through torch (8 x 32, 2026-12-06).
MEAN_LOGPROB_DIFF = {"int8": 0.035, "fp8": 0.06}
PROMPTS = PARITY_PROMPTS[:8]
STORY = ("In a quiet village at the edge of a great forest, there lived an old clockmaker who repaired every "
         "clock in the valley. One winter morning, a stranger arrived carrying a broken pocket watch.")
TOKENS = 32


def test_kv_cache_dtype_names_resolve_like_vllms():
    assert kv_memory.resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"
    assert kv_memory.resolve_kv_cache_dtype("fp8", "float32") == "fp8_e4m3"
    assert kv_memory.resolve_kv_cache_dtype("int8", "float16") == "int8"
    assert kv_memory.resolve_kv_cache_dtype("float32", "float32") == "float32"
    with pytest.raises(ValueError, match=r"kv_cache_dtype bfloat16 with a model served in float32: .* use auto, or an 8-bit"):
        kv_memory.resolve_kv_cache_dtype("bfloat16", "float32")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, bfloat16, .*, int8; got 'fp4'"):
        kv_memory.resolve_kv_cache_dtype("fp4", "bfloat16")
    # 64 codes + a 4-byte scale per (token, head) against 64 x 2 bytes
    assert (kv_memory.kv_row_bytes(64, "int8"), kv_memory.kv_row_bytes(64, "bfloat16")) == (68, 128)
    assert kv_memory.kv_bytes_per_token(30, 3, 64, "fp8_e5m2") == 2 * 30 * 3 * 68


def test_serve_flag_environment_and_bad_values(capsys):
    assert engine_config(parse_args(["--kv-cache-dtype", "fp8"], environ={})).kv_cache_dtype == "fp8"
    assert engine_config(parse_args([], environ={"TOKENMILL_KV_CACHE_DTYPE": "int8"})).kv_cache_dtype == "int8"
    assert engine_config(parse_args([], environ={})).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "int4"], environ={})
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 with a model served in float32"):
        LLM(dtype="float32", kv_cache_dtype="bfloat16", num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp8_e5m2"])
def test_the_pool_holds_the_bytes_kv_memory_counts(tiny_dir, kv):
    """The worker's pool is kv_bytes_per_token x tokens exactly, of the 8-bit dtype with the scale columns,
    and the same memory buys more blocks than the fp32 cache (tiny llama: head_dim 16, 2 KV heads, 2 layers)."""
    budget = 1 << 20
    llm = LLM(model=str(tiny_dir), dtype="float32", kv_cache_dtype=kv, kv_cache_memory=budget, max_model_len=256)
    cap, pool = llm.capacity, llm.engine.core.executor.worker.runner.kv_pool
    assert cap.kv_bytes_per_token == 2 * 2 * 2 * (16 + 4) == 160  # fp32: 2 x 2 x 2 x 16 x 4 = 512
    assert cap.num_kv_blocks == budget // (16 * 160) == 409
    assert pool.element_size() == 1 and pool.shape[-1] == 20
    assert pool.numel() == cap.num_kv_blocks * 16 * cap.kv_bytes_per_token
    assert cap.kv_cache_dtype == kv and cap.kv_cache_dtype_resolved == kv_memory.resolve_kv_cache_dtype(kv, "float32")
    assert f"160 bytes/token ({cap.kv_cache_dtype_resolved} cache, float32 model on cpu)" in cap.describe()


def test_preemption_and_prefix_hits_on_an_8bit_cache_change_no_token_and_leak_no_block(tiny_dir):
    """A pool too small for the batch (recompute preemption re-quantizes the same values) and a second pass
    served from the prefix cache give the tokens of a large pool."""
    # A shared opening longer than two blocks: full blocks for the prefix cache, 4-5 blocks per sequence.
    prompts = [f"{STORY} {p}" for p in PROMPTS[:4]]
    big = LLM(model=str(tiny_dir), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=256, max_model_len=128)
    small = LLM(model=str(tiny_dir), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=8, max_model_len=128)
    want = [o.outputs[0].token_ids for o in generate_greedy(big, prompts, 24, top_k=1)]
    assert [o.outputs[0].token_ids for o in generate_greedy(small, prompts, 24, top_k=1)] == want
    assert small.stats()["num_preemptions"] > 0
    small.reset_stats()
    assert [o.outputs[0].token_ids for o in generate_greedy(small, prompts[:2], 24, top_k=1)] == want[:2]
    assert small.stats()["prefix_cache_hit_tokens"] > 0
    assert small.stats()["kv_blocks_in_use"] == big.stats()["kv_blocks_in_use"] == 0


@pytest.fixture(scope="module")
def bundled():
    """dtype -> {kv_cache_dtype: LLM} of the bundled model, built once per dtype for this module."""
    made: dict[str, dict[str, LLM]] = {}

    def get(dtype: str, caches: tuple[str, ...]) -> dict[str, LLM]:
        llms = made.setdefault(dtype, {})
        for kv in ("auto", *caches):
            if kv not in llms:
                llms[kv] = LLM(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=16 << 20, max_model_len=128)
        return llms

    return get


@pytest.mark.parametrize(("dtype", "caches"), [("bfloat16", ("int8", "fp8")), ("float32", ("int8",))])
def test_8bit_caches_keep_greedy_parity_with_the_models_dtype_cache(bundled, dtype, caches):
    """The bundled model, 8 prompts x 32 greedy tokens, against its bf16 (or fp32) cache."""
    llms = bundled(dtype, caches)
    reference = generate_greedy(llms["auto"], PROMPTS, TOKENS)
    for kv in caches:
        p = greedy_parity(reference, generate_greedy(llms[kv], PROMPTS, TOKENS))
        what = f"{kv} vs {dtype}: {p}"
        print(what)
        assert p.divergent_in_top_k, what
        assert 0 < p.max_abs_logprob_diff <= MAX_LOGPROB_DIFF[kv], what  # 0 would mean no quantization ran
        assert p.mean_abs_logprob_diff <= MEAN_LOGPROB_DIFF[kv], what
        assert p.compared_steps >= len(PROMPTS) * TOKENS // 2, what


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_fused_cpu_layer_loop_reads_an_8bit_cache_as_the_python_loop_does(bundled, monkeypatch, dtype):
    """kernels/csrc/cpu_decoder.cpp calls the same C++ store and attention ops, which take the 8-bit cache
    as it is: its tokens and logprobs are the Python layer loop's bit for bit (where the CPU runs the loop:
    fp32 wherever the packed kernels build, bf16 only with the AVX-512 BF16 dot kernels)."""
    llm = bundled(dtype, ("int8",))["int8"]
    calls = []
    run = llama_cpu_decoder.run_layers
    monkeypatch.setattr(llama_cpu_decoder, "run_layers", lambda *a, **k: calls.append(1) or run(*a, **k))
    fused = generate_greedy(llm, PROMPTS[:6], 12, top_k=3)
    monkeypatch.setattr(llama_cpu_decoder, "step_fits", lambda hidden, rope, md: False)
    python = generate_greedy(llm, PROMPTS[:6], 12, top_k=3)
    assert bool(calls) == llama_cpu_decoder.fused_layers_enabled(getattr(torch, dtype))
    for a, b in zip(fused, python, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_decode_step_time_swamped_by_noise_is_not_reported_as_negative():
    """bench kv-cache times decode as the difference of a short and a long run; when the short one took longer
    (its prefill slowed by other work) nothing was measured: inf for the rounds' minimum, None in the report,
    rather than the negative step time an AVX2 run printed (2026-12-06)."""
    import math
    import time

    from tokenmill.engine.bench.kv_cache import _ms, _ratio, decode_step_seconds

    class Busy:  # the short run burns more CPU than the long one: a slowed prefill
        steps = 0

        def reset_stats(self):
            self.steps = 0

        def generate(self, _texts, params, prompt_token_ids, use_tqdm):
            end = time.process_time() + (0.05 if params.max_tokens < 10 else 0.01)
            while time.process_time() < end:
                pass
            self.steps = params.max_tokens

        def stats(self):
            return {"num_steps": self.steps}

    wall, cpu = decode_step_seconds(Busy(), 2, 4, 4, 20)
    assert math.isinf(wall) and math.isinf(cpu)
    assert _ms(wall) is None and _ratio(0.01, wall) is None
    assert _ms(0.0123) == 12.3 and _ratio(0.02, 0.01) == 2.0
