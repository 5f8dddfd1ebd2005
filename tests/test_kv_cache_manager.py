"""Block manager invariants under random allocate/compute/append/fork/free sequences, plus the
prefix-cache behaviours the scheduler relies on."""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], index: int = 0) -> Request:
    return Request(rid, index, list(tokens), len(tokens), SamplingParams(), arrival_time=0.0)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BS, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, tokens: list[int]) -> None:
        req = make_req(f"r{self.n}", tokens)
        self.n += 1
        hits = self.kv.get_computed_blocks(req)
        for i, b in enumerate(hits):  # every hit holds exactly the tokens it claims
            assert self.kv.blocks[b].identity[1] == tuple(tokens[i * BS : (i + 1) * BS])
        assert len(hits) * BS < len(tokens)  # at least one token is left to compute
        used_before = self.kv.num_used_blocks
        req.num_computed_tokens = 0
        if self.kv.allocate_slots(req, len(tokens) - len(hits) * BS, hits):
            req.num_computed_tokens = len(tokens)
            self.kv.cache_full_blocks(req)
            self.live[req.key] = req
        else:
            assert self.kv.num_used_blocks == used_before  # refusal changes nothing
            assert req.key not in self.kv.req_blocks

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data: st.DataObject, token: int) -> None:
        req = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.key)))
        req.token_ids.append(token)
        if self.kv.allocate_slots(req, 1):
            req.num_computed_tokens += 1
            self.kv.cache_full_blocks(req)
        else:
            req.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.key)))
        child = make_req(parent.request_id, parent.token_ids, index=1000 + self.n)
        self.n += 1
        shared = (child.num_tokens - 1) // BS
        self.kv.fork(parent, child, shared)
        child.num_computed_tokens = shared * BS
        if self.kv.allocate_slots(child, child.num_tokens - shared * BS):
            child.num_computed_tokens = child.num_tokens
            self.live[child.key] = child
        else:
            self.kv.free(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.key)))
        self.kv.free(req)
        del self.live[req.key]

    @invariant()
    def refcounts_match_tables(self) -> None:
        refs = Counter(b for blocks in self.kv.req_blocks.values() for b in blocks)
        for block in self.kv.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0)
            assert (block.ref_cnt == 0) == (block.block_id in self.kv.free_queue)
        assert self.kv.num_used_blocks + self.kv.num_free_blocks == self.kv.num_blocks

    @invariant()
    def tables_cover_tokens(self) -> None:
        for req in self.live.values():
            assert len(self.kv.block_ids(req)) * BS >= req.num_computed_tokens

    @invariant()
    def cache_map_consistent(self) -> None:
        for h, b in self.kv.cached.items():
            assert self.kv.blocks[b].block_hash == h
            assert self.kv.blocks[b].identity is not None

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.kv.free(req)
        assert self.kv.num_used_blocks == 0


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_freed_blocks_are_reused_from_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    first_two = kv.block_ids(a)[:2]
    kv.free(a)
    assert kv.num_used_blocks == 0
    b = make_req("b", [*range(8), 99, 98, 97])
    assert kv.get_computed_blocks(b) == first_two


def test_hash_collision_never_returns_wrong_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    block = kv.blocks[kv.block_ids(a)[0]]
    b = make_req("b", [9, 9, 9, 9, 9])
    # Forge a collision: the key [9, 9, 9, 9] maps to now points at a block holding [1, 2, 3, 4].
    kv.cached[kv.block_hashes(b, 1)[0]] = block.block_id
    assert kv.get_computed_blocks(b) == []


def test_tail_blocks_are_evicted_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", [*list(range(12)), 50])
    assert kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    kv.cache_full_blocks(a)
    blocks = kv.block_ids(a)
    kv.free(a)
    # The un-hashed partial tail goes first, then the full blocks from the tail backwards.
    assert list(kv.free_queue) == [blocks[3], blocks[2], blocks[1], blocks[0]]


def test_allocation_refused_without_side_effects_when_pool_is_full() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_req("a", list(range(9)))
    assert not kv.allocate_slots(a, 9)  # needs 3 blocks, 2 exist
    assert kv.num_used_blocks == 0 and a.key not in kv.req_blocks
