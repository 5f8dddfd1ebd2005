"""The scheduler keeps a step within the LoRA slots, without a model: a request whose adapter cannot get a
slot waits, base requests pass it, later adapter requests queue behind it (no starvation), and the
adapters it reports are vllm:lora_requests_info's."""

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.kv_cache_manager import KVCacheManager, encode_extra_keys, extra_keys
from tokenmill.engine.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams

A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")


def seq(rid: str, arrival: float, lora: LoRARequest | None, max_tokens: int = 2) -> Request:
    return Request(rid, 0, [1, 2, 3, 4, 5], 5, SamplingParams(max_tokens=max_tokens), arrival, lora_request=lora)


def scheduler(max_loras: int) -> Scheduler:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_loras=max_loras)
    return Scheduler(config, kv, max_model_len=64)


def step(s: Scheduler) -> list[str]:
    """One step as the engine core runs it (every scheduled sequence samples token 7); the ids scheduled."""
    out = s.schedule()
    sampled = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
    s.update_from_output(out, [7] * len(sampled), [None] * len(sampled), sampled)
    return [r.request_id for r, _ in out.scheduled]


def test_adapter_without_a_slot_waits_base_passes_and_later_adapter_requests_queue_behind_it():
    s = scheduler(max_loras=1)
    for rid, arrival, lora in [("a1", 0, A), ("b1", 1, B), ("base", 2, None), ("a2", 3, A)]:
        s.add_request(seq(rid, arrival, lora))
    # a1 takes the slot; b1 waits; base needs none; a2's adapter is running, but it arrived after b1.
    assert step(s) == ["a1", "base"]
    stats = s.make_stats(SchedulerOutput())  # what the step's outputs report
    assert stats.running_lora_adapters == {"a": 1} and stats.waiting_lora_adapters == {"b": 1, "a": 1}
    while "a1" in s.requests:
        step(s)
    assert step(s) == ["b1"]  # a's slot is free: b1 first, a2 still behind it
    while "b1" in s.requests:
        step(s)
    assert step(s) == ["a2"]


def test_a_stream_of_requests_for_running_adapters_does_not_starve_a_waiting_one():
    s = scheduler(max_loras=1)
    s.add_request(seq("a0", 0, A, max_tokens=3))
    assert step(s) == ["a0"]
    s.add_request(seq("b", 1, B))
    arrival, ran_b = 2, None
    for i in range(20):
        s.add_request(seq(f"a{arrival}", arrival, A, max_tokens=3))  # one more request for `a` every step
        arrival += 1
        if "b" in step(s):
            ran_b = i
            break
    assert ran_b is not None and ran_b <= 3  # once a0 finished, b got the slot before the newer a requests


def test_two_slots_never_hold_three_adapters_in_one_step():
    s = scheduler(max_loras=2)
    c = LoRARequest("c", 3, "/c")
    for i, lora in enumerate([A, B, c, A, B, c, None]):
        s.add_request(seq(f"r{i}", i, lora, max_tokens=4))
    while s.has_unfinished():
        out = s.schedule()
        assert len({r.lora_request.lora_int_id for r, _ in out.scheduled if r.lora_request}) <= 2
        sampled = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
        s.update_from_output(out, [7] * len(sampled), [None] * len(sampled), sampled)
    assert s.kv.num_used_blocks == 0


def test_block_keys_differ_by_adapter_and_salt_and_never_collide_across_them():
    def keys(salt: str | None, lora: LoRARequest | None) -> bytes:
        r = seq("x", 0, lora)
        r.cache_salt = salt
        return encode_extra_keys(extra_keys(r, 0))  # the bytes the block's hash covers

    variants = [keys(None, None), keys(None, A), keys(None, B), keys("s", None), keys("s", A), keys("s", B),
                keys(None, LoRARequest("a", 3, "/a"))]  # fmt: skip
    assert keys(None, None) == b"" and len(set(variants)) == len(variants)  # a reload (new id) is a new key too
    assert extra_keys(seq("x", 0, A), 1) is None  # later blocks inherit it through the chain
