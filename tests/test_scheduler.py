"""Scheduler decisions on a real KVCacheManager, without a model: what the queue does when blocks are short."""

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling_params import SamplingParams

BS = 4


def seq(rid: str, num_tokens: int, arrival: float, index: int = 0) -> Request:
    return Request(
        rid, index, list(range(1, num_tokens + 1)), num_tokens, SamplingParams(max_tokens=8), arrival
    )


def scheduler(num_blocks: int) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=True)
    return Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, max_model_len=24)


def waiting_forked_choice(s: Scheduler) -> Request:
    """Choice 1 of a 9-token prompt, forked after its parent's prefill and queued holding 2 shared blocks;
    the parent is gone (finished or preempted)."""
    parent, child = seq("p", 9, arrival=1.0), seq("p", 9, arrival=1.0, index=1)
    assert s.kv.allocate_slots(parent, 9)
    s.kv.fork(parent, child, 2)
    child.num_computed_tokens = 2 * BS
    s.kv.free(parent)
    s.requests["p"] = [child]
    s.add_request_seq(child)
    return child


def test_head_of_queue_takes_back_blocks_a_forked_choice_holds_while_waiting() -> None:
    # A forked n > 1 choice waits holding its parent's prompt blocks; the request ahead of it in the
    # queue needs more blocks than are left. Before the fix the head waited for the choice and the
    # choice waited behind the head: nothing ran again (the soak test's hung requests).
    s = scheduler(num_blocks=6)
    child = waiting_forked_choice(s)
    head = seq("x", 17, arrival=0.0)  # 5 blocks of the 4 the child leaves free
    s.add_request(head)
    assert s.kv.num_blocks - s.kv.num_used_blocks == 4

    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("x", 17)]
    assert (
        s.kv.block_ids(child) == []
        and child.num_computed_tokens == 0
        and child.status is RequestStatus.WAITING
    )
    assert out.num_preemptions == 1  # the choice's computed prompt is given up, and counted

    # Once the head is done, the choice runs, its prompt taken from the prefix cache where still there.
    s.running.remove(head)
    s.finish(head, "length")
    out = s.schedule()
    assert [(r.request_id, r.index) for r, _ in out.scheduled] == [("p", 1)]
    assert s.kv.num_used_blocks == len(s.kv.block_ids(child)) == 3


def test_head_that_fits_leaves_a_waiting_choice_its_blocks() -> None:
    s = scheduler(num_blocks=8)
    child = waiting_forked_choice(s)
    s.add_request(seq("x", 17, arrival=0.0))  # 5 blocks of the 6 free, and 1 left for the choice's last token

    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("x", 17), ("p", 1)]
    assert len(s.kv.block_ids(child)) == 3 and child.num_computed_tokens == 8 and out.num_preemptions == 0
