"""Tensor and pipeline parallel through the offline API: the same greedy tokens as one rank, in fp32 on CPU.

Each parallel engine starts real worker processes (gloo on loopback). Tiny random models keep it cheap.
"""

import pathlib

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model
from tokenmill.engine import kv_memory
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.model_config import load_model_config
from tokenmill.engine.outputs import EngineCoreRequest
from tokenmill.engine.parallel_state import kv_head_range, layer_range, validate_parallel, vocab_shard
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.step_input import StepInput, pack, unpack

PROMPTS = [
    [1, 5, 9, 200, 300, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
    [1, 5, 9, 200, 300, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 40, 41],  # a 16-token prefix hit
    [7, 8, 9, 10, 11],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp"), "qwen2", vocab_size=1000)  # qkv biases too


def _generate(model: pathlib.Path, tp: int, pp: int, num_kv_blocks: int = 64) -> tuple[list, dict]:
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
        num_kv_blocks=num_kv_blocks, max_model_len=64, max_num_batched_tokens=24,
    )  # fmt: skip
    core = EngineCore(config)  # the core alone: prompts are token ids, no tokenizer needed
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        core.add_request(_request("0", PROMPTS[0], params))
        steps = 0
        while core.has_unfinished_requests():
            outputs, _ = core.step()
            steps += 1
            if steps == 1:  # the first prompt's full block is cached now: the second one hits it
                for i, ids in enumerate(PROMPTS[1:], start=1):
                    core.add_request(_request(str(i), ids, params))
            for o in outputs:
                tokens[o.request_id] += o.new_token_ids
        stats = core.stats()
    finally:
        core.shutdown()
    return [tokens[str(i)] for i in range(len(PROMPTS))], stats


def _request(rid: str, ids: list[int], params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(rid, ids, params, 0.0, 0)


@pytest.fixture(scope="module")
def reference(tiny):
    return _generate(tiny, 1, 1)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_parallel_greedy_tokens_equal_one_rank(tiny, reference, tp, pp):
    ref_tokens, ref_stats = reference
    # 8 blocks of 16 for 3 sequences growing to 43 tokens (3 blocks each): they cannot all run at once.
    tokens, stats = _generate(tiny, tp, pp, num_kv_blocks=8)
    assert tokens == ref_tokens
    assert stats["kv_blocks_in_use"] == 0
    assert ref_stats["kv_blocks_in_use"] == 0


def test_reference_run_is_not_trivial(reference):
    tokens, _ = reference
    assert all(len(t) == 24 for t in tokens)
    assert len({tuple(t) for t in tokens}) == len(tokens)


# ---- pieces, no processes ------------------------------------------------------------------------
def test_bad_splits_are_refused_with_the_numbers(bundled_model_dir):
    mc = load_model_config(bundled_model_dir)  # 9 heads, 3 KV heads, 30 layers
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's 9 attention heads"):
        validate_parallel(EngineConfig(tensor_parallel_size=2), mc, "cpu")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=31 is more than the model's 30 layers"):
        validate_parallel(EngineConfig(pipeline_parallel_size=31), mc, "cpu")
    if torch.cuda.device_count() < 3:
        with pytest.raises(ValueError, match=r"needs 3 GPUs per node .* but \d+ are present"):
            validate_parallel(EngineConfig(tensor_parallel_size=3), mc, "cuda")
    validate_parallel(EngineConfig(tensor_parallel_size=3, pipeline_parallel_size=2), mc, "cpu")


def test_engine_refuses_a_bad_split_before_loading_weights(tmp_path):
    model = make_tiny_model(tmp_path, "llama", vocab_size=1000)  # 4 heads
    for f in model.glob("*.safetensors"):
        f.write_bytes(b"not weights")  # reading them would fail differently
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        EngineCore(EngineConfig(model=str(model), device="cpu", tensor_parallel_size=3))


def test_shards_cover_heads_layers_and_vocab_exactly_once():
    # KV heads replicated: 3 KV heads over 3 and 9 ranks; split: 8 over 4.
    assert [kv_head_range(3, r, 3) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    assert [kv_head_range(3, r, 9)[0] for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [kv_head_range(8, r, 4) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    layers = [list(layer_range(30, s, 4)) for s in range(4)]
    assert [i for x in layers for i in x] == list(range(30)) and [len(x) for x in layers] == [8, 8, 7, 7]
    rows = [vocab_shard(49153, r, 2) for r in range(2)]
    assert rows == [(0, 24577), (24577, 24577)]


def test_kv_bytes_per_rank_shrink_with_tensor_and_pipeline_parallel():
    one = kv_memory.kv_bytes_per_token(30, 3, 64, "float32")
    assert one == 2 * 30 * 3 * 64 * 4
    assert kv_memory.kv_bytes_per_token(30, 3, 64, "float32", tensor_parallel=3) * 3 == one
    # 6 ranks over 3 KV heads: replicated, one head per rank, as with 3.
    assert kv_memory.kv_bytes_per_token(30, 3, 64, "float32", 6) == kv_memory.kv_bytes_per_token(30, 3, 64, "float32", 3)
    assert kv_memory.kv_bytes_per_token(30, 3, 64, "float32", 1, 2) * 2 == one


def test_step_input_round_trips_through_one_array():
    step = StepInput(
        input_ids=np.array([5, 6, 7], dtype=np.int64),
        positions=np.array([0, 1, 4], dtype=np.int64),
        slot_mapping=np.array([16, 17, 36], dtype=np.int64),
        query_start_loc=np.array([0, 2, 3], dtype=np.int32),
        seq_lens=np.array([2, 5], dtype=np.int32),
        block_tables=np.array([[1, 0], [2, 3]], dtype=np.int32),
        sample_rows=np.array([1, 2], dtype=np.int64),
        decode_only=False,
    )
    back = unpack(pack(step))
    for name in StepInput.__slots__:
        a, b = getattr(step, name), getattr(back, name)
        assert np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype, name
