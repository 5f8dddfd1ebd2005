"""Random traffic on a tiny KV pool through the real EngineCore (tiny random Llama): requests with n up
to 3 arrive while others run, preemption is constant, and the engine must never sit with unfinished
requests and nothing to run. The soak test over HTTP found such a stall once (forked choices holding
blocks behind the queue's head, see scheduler.py); this finds it in seconds and without a server."""

import random

import pytest
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.engine.sampling_params import SamplingParams

from tests.tiny_models import make_tiny_model

NUM_REQUESTS = 20


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    # 20 blocks of 16 for sequences of up to 256 tokens, as the soak test's server.
    return LLMEngine(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=20, max_model_len=256, max_num_seqs=6)
    )


# Before the fix (scheduler.py: _release_waiting_blocks) seeds 1 and 3 stalled, each within 2 s.
@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_with_n_up_to_3_never_stall(engine: LLMEngine, seed: int) -> None:
    rng = random.Random(seed)
    added = steps = idle = 0
    finished: set[str] = set()
    preemptions_before = engine.core.stats()["num_preemptions"]
    while added < NUM_REQUESTS or engine.has_unfinished_requests():
        if added < NUM_REQUESTS and rng.random() < 0.3:
            ids = [rng.randint(10, 1000) for _ in range(rng.randint(60, 200))]
            params = SamplingParams(
                n=rng.choice([1, 2, 3]),
                max_tokens=rng.randint(4, 40),
                ignore_eos=True,
                temperature=0.8,
                seed=1,
            )
            engine.add_request(None, ids, params, request_id=f"{seed}-{added}")
            added += 1
        outputs, stats = engine.core.step()
        results, _ = engine.processor.process_outputs(outputs)
        finished.update(r.request_id for r in results if r.finished)
        steps += 1
        # Nothing scheduled while requests wait and none arrive: stalled for good.
        idle = idle + 1 if stats.num_scheduled_tokens == 0 and added == NUM_REQUESTS else 0
        if idle > 3:
            s = engine.core.scheduler
            waiting = [(r.key, r.num_tokens, len(engine.core.kv.block_ids(r))) for r in sorted(s.waiting)]
            free = engine.core.kv.num_blocks - engine.core.kv.num_used_blocks
            for rid in list(s.requests):  # the next seed starts from an idle engine
                engine.abort_request(rid)
            pytest.fail(
                f"stalled at step {steps}: {len(s.running)} running; waiting (key, tokens, blocks held) "
                f"{waiting}; {free} blocks free"
            )
    assert finished == {f"{seed}-{i}" for i in range(NUM_REQUESTS)}
    assert engine.core.kv.num_used_blocks == 0
    assert engine.core.stats()["num_preemptions"] > preemptions_before, (
        "the pool was meant to force preemption"
    )
