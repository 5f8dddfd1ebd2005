"""LoRA adapters against Hugging Face transformers + PEFT, greedy, fp32 on CPU: every row of a mixed batch
(base rows, rows of three adapters made by PEFT on tiny models of every architecture) equals PEFT's tokens,
through chunked prefill, prefix-cache hits, preemption and more adapters than slots; the same under tensor
parallelism; and a prefix computed under one adapter is never served to another or to the base model."""

import functools
import pathlib

import pytest
from lora_adapters import make_peft_adapter, peft_greedy
from tiny_models import TINY_ARCHS, make_tiny_model
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.sampling_params import SamplingParams

MAX_TOKENS = 16
PREFIX = [1, 5, 9, 200, 300, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]  # one full block of 16
PROMPTS = [
    [*PREFIX, 28, 29, 30],
    [*PREFIX, 40, 41],  # hits the first prompt's block under the same adapter (or none)
    [7, 8, 9, 10, 11],
    [(7 * i) % 990 + 3 for i in range(30)],  # longer than a step's 24 tokens: chunked prefill
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COLLECTIVE_TIMEOUT_S = 300  # a rank's first forward can take a minute on a loaded 2-core machine


def _adapters(base: pathlib.Path, root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Three adapters that differ in what they cover: every target at rank 8; q/v/down at rank 4 with
    rank-stabilized scaling; o/gate/up at rank 8 with another alpha."""
    return {
        "a": make_peft_adapter(base, root / "a", r=8, alpha=16, seed=1),
        "b": make_peft_adapter(base, root / "b", r=4, alpha=8, seed=2, targets=("q_proj", "v_proj", "down_proj"),
                               use_rslora=True),
        "c": make_peft_adapter(base, root / "c", r=8, alpha=32, seed=3, targets=("o_proj", "gate_proj", "up_proj")),
    }  # fmt: skip


# (adapter or None, prompt index): the first wave runs alone for a step (its full blocks get cached), the
# second wave then hits them, under the same adapter only.
FIRST = [(None, 0), ("a", 0), ("b", 0)]
SECOND = [(None, 1), ("a", 1), ("b", 1), ("c", 2), ("a", 3), (None, 2), ("c", 0), ("b", 3)]


def _run(base: pathlib.Path, adapters: dict[str, pathlib.Path], *, tp: int = 1, pp: int = 1, masked: bool = False,
         num_kv_blocks: int = 10) -> tuple[dict[int, list[int]], dict]:  # fmt: skip
    """Tokens per row of FIRST + SECOND through one engine with 2 slots for 3 adapters, a 24-token step
    budget and a pool of 10 blocks of 16 (preemptions); masked: the CUDA path's masked product, on CPU."""
    config = EngineConfig(
        model=str(base), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
        max_cpu_loras=2, num_kv_blocks=num_kv_blocks, max_model_len=64, max_num_batched_tokens=24,
        tensor_parallel_size=tp, pipeline_parallel_size=pp, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )  # fmt: skip
    core = EngineCore(config)
    if masked:
        lora = core.executor.worker.lora
        lora.state.__init__(2, True, 64, lora.dtype, core.executor.device)  # the CUDA path, on CPU
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    rows = FIRST + SECOND
    tokens: dict[int, list[int]] = {}
    adapters_per_step: list[int] = []
    waited_for_a_slot = False
    try:
        for i, (name, p) in enumerate(FIRST):
            core.add_request(_request(i, p, name, adapters, ids))
        steps = 0
        while core.has_unfinished_requests():
            outputs, stats = core.step()
            steps += 1
            adapters_per_step.append(len(stats.running_lora_adapters))
            waited_for_a_slot |= bool(set(stats.waiting_lora_adapters) - set(stats.running_lora_adapters))
            if steps == 2:
                for j, (name, p) in enumerate(SECOND):
                    core.add_request(_request(len(FIRST) + j, p, name, adapters, ids))
            for o in outputs:
                tokens.setdefault(int(o.request_id), []).extend(o.new_token_ids)
        stats = core.stats()
    finally:
        core.shutdown()
    assert len(tokens) == len(rows)
    assert max(adapters_per_step) == 2  # both slots were used, never more
    assert waited_for_a_slot  # the third adapter waited for one
    return tokens, stats


def _request(i: int, p: int, name: str | None, adapters: dict, ids: dict) -> EngineCoreRequest:
    lora = None if name is None else LoRARequest(name, ids[name], str(adapters[name]))
    return EngineCoreRequest(str(i), PROMPTS[p], GREEDY, float(i), 0, None, lora)


def _reference(base: pathlib.Path, adapters: dict[str, pathlib.Path]) -> dict[int, list[int]]:
    """PEFT's tokens for every row. The adapters must change them, or equality would prove nothing."""
    want = {None: peft_greedy(base, None, PROMPTS, MAX_TOKENS)}
    for name, path in adapters.items():
        want[name] = peft_greedy(base, path, PROMPTS, MAX_TOKENS)
        assert all(w != b for w, b in zip(want[name], want[None], strict=True)), name
    return {i: want[name][p] for i, (name, p) in enumerate(FIRST + SECOND)}


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("lora")


@functools.cache  # one model and its adapters per architecture for the whole module
def _model_and_adapters(root: pathlib.Path, arch: str) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    base = make_tiny_model(root / arch, arch, vocab_size=1000)
    return base, _adapters(base, root / arch / "adapters")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_row_of_a_mixed_batch_equals_peft(tiny_root, arch):
    base, adapters = _model_and_adapters(tiny_root, arch)
    want = _reference(base, adapters)
    got, stats = _run(base, adapters)
    assert got == want
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] >= 3 * 16  # base, a and b each hit their own first prompt's block
    assert stats["kv_blocks_in_use"] == 0


def test_masked_product_of_cuda_graphs_equals_peft_on_cpu(tiny_root):
    base, adapters = _model_and_adapters(tiny_root, "qwen2")
    got, _ = _run(base, adapters, masked=True)
    assert got == _reference(base, adapters)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_parallel_rows_equal_peft(tiny_root, tp, pp):
    base, adapters = _model_and_adapters(tiny_root, "qwen2")  # qkv biases; 4 heads, 2 KV heads: TP=2
    got, stats = _run(base, adapters, tp=tp, pp=pp)
    assert got == _reference(base, adapters)
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_in_use"] == 0


def test_same_prompt_under_two_adapters_and_the_base_shares_no_prefix_block(tiny_root):
    base, adapters = _model_and_adapters(tiny_root, "llama")
    config = EngineConfig(model=str(base), dtype="float32", device="cpu", enable_lora=True, max_loras=2,
                          max_lora_rank=8, num_kv_blocks=64, max_model_len=64)  # fmt: skip
    core = EngineCore(config)
    a = LoRARequest("a", 1, str(adapters["a"]))
    b = LoRARequest("b", 2, str(adapters["b"]))
    prompt = PROMPTS[3]  # 30 tokens: one full block to share, at most
    cached: dict[str, int] = {}
    blocks: dict[str, list[int]] = {}
    for i, (label, lora) in enumerate([("base", None), ("a", a), ("b", b), ("a again", a), ("base again", None)]):
        core.add_request(EngineCoreRequest(str(i), prompt, GREEDY, float(i), 0, None, lora))
        seq = core.scheduler.requests[str(i)][0]
        core.step()  # admits it (looking up the prefix cache) and runs its prefill
        blocks[label] = list(core.kv.block_ids(seq))
        while core.has_unfinished_requests():
            core.step()
        cached[label] = seq.num_cached_tokens
    assert cached == {"base": 0, "a": 0, "b": 0, "a again": 16, "base again": 16}
    assert not set(blocks["a"]) & set(blocks["base"]) and not set(blocks["b"]) & set(blocks["base"])
    assert not set(blocks["a"]) & set(blocks["b"])
    assert blocks["a again"][0] == blocks["a"][0] and blocks["base again"][0] == blocks["base"][0]
