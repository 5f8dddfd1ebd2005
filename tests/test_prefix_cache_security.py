"""The prefix cache is tenant-safe: chained SHA-256 keys, cache_salt in the first block, and every hit
verified against what the block was computed from, so a forged key collision cannot change output.

Engine tests run a real EngineCore on a tiny random Llama (fp32, real weights in an HF folder); the
reference for "unchanged output" is the same prompt on an engine with prefix caching off.
"""

import pathlib

import pytest
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.core.kv_cache_manager import ROOT_HASH, KVCacheManager, extra_keys, hash_block_tokens
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams

from tests.tiny_models import make_tiny_model

BS = 16
VOCAB = 256
MAX_TOKENS = 6


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, 0, list(tokens), len(tokens), SamplingParams(), arrival_time=0.0, cache_salt=salt)


def admit_and_compute(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit req the way the scheduler does, mark its prompt computed, register its full blocks."""
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * kv.block_size, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return hits


# ---- the key -----------------------------------------------------------------------------------------
def test_block_key_is_sha256_of_parent_tokens_and_extra_keys() -> None:
    import hashlib
    import struct

    tokens = tuple(range(BS))
    # A reference written here: parent digest, then each token as a little-endian int64, then the extras.
    expected = hashlib.sha256(ROOT_HASH + struct.pack(f"<{BS}q", *tokens) + b"salt").digest()
    assert hash_block_tokens(ROOT_HASH, tokens, b"salt") == expected
    assert len(expected) == 32


def test_keys_chain_so_the_same_block_after_another_prefix_has_another_key() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    shared_tail = list(range(100, 100 + BS))
    a = make_req("a", [*range(BS), *shared_tail, 1])
    b = make_req("b", [*range(1, BS + 1), *shared_tail, 1])
    assert kv.block_hashes(a, 2)[1] != kv.block_hashes(b, 2)[1]


# ---- cache_salt ----------------------------------------------------------------------------------------
def test_different_salts_share_no_blocks_and_the_same_salt_shares() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = list(range(3 * BS + 5))
    admit_and_compute(kv, make_req("a", prompt, salt="tenant-a"))
    assert admit_and_compute(kv, make_req("b", prompt, salt="tenant-b")) == []
    assert admit_and_compute(kv, make_req("c", prompt, salt=None)) == []
    assert len(admit_and_compute(kv, make_req("a2", prompt, salt="tenant-a"))) == 3
    assert len(admit_and_compute(kv, make_req("c2", prompt, salt=None))) == 3
    # A salt cannot be forged by spelling part of it into the prompt: lengths are part of the key.
    assert admit_and_compute(kv, make_req("d", prompt, salt="tenant-a\x00")) == []


def test_a_forged_key_pointing_at_another_salts_block_is_refused() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(BS + 1))
    a = make_req("a", prompt, salt="tenant-a")
    admit_and_compute(kv, a)
    victim = make_req("v", prompt, salt="tenant-b")
    kv.cached[kv.block_hashes(victim, 1)[0]] = kv.block_ids(a)[0]  # same tokens, same (root) parent
    assert kv.get_computed_blocks(victim) == []


# ---- forged collisions: the old kind -------------------------------------------------------------------
def test_forged_collision_with_the_same_tokens_after_another_prefix_is_refused() -> None:
    """The old scheme (Python's tuple hash, checking only a block's own tokens) accepted this: a block
    holding the victim's tokens, computed after a different prefix, found under the victim's key."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    middle = list(range(50, 50 + BS))
    attacker = make_req("attacker", [*[7] * BS, *middle, 3])
    other = make_req("other", [*[9] * BS, 4])  # caches the victim's first block honestly
    admit_and_compute(kv, attacker)
    admit_and_compute(kv, other)
    victim = make_req("victim", [*[9] * BS, *middle, 5])
    kv.cached[kv.block_hashes(victim, 2)[1]] = kv.block_ids(attacker)[1]
    assert kv.get_computed_blocks(victim) == kv.block_ids(other)[:1]  # the honest hit only


def test_hit_verification_checks_tokens_even_under_the_right_key() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", list(range(BS + 1)))
    admit_and_compute(kv, a)
    b = make_req("b", [9] * (BS + 1))
    kv.cached[kv.block_hashes(b, 1)[0]] = kv.block_ids(a)[0]
    assert kv.get_computed_blocks(b) == []


# ---- end to end: a forged collision cannot change output ------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", vocab_size=VOCAB)


def make_core(model: pathlib.Path, prefix_caching: bool) -> EngineCore:
    return EngineCore(EngineConfig(
        model=str(model), dtype="float32", device="cpu", block_size=BS, max_model_len=256, num_kv_blocks=64,
        enable_prefix_caching=prefix_caching,
    ))  # fmt: skip


def run(core: EngineCore, rid: str, prompt: list[int]) -> list[tuple[int, float]]:
    """Greedy tokens with their logprobs (the logprob shows a KV difference even when the token agrees)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    core.add_request(EngineCoreRequest(rid, prompt, params, arrival_time=0.0))
    out: list[tuple[int, float]] = []
    while core.has_unfinished_requests():
        for o in core.step()[0]:
            out.extend((t, lp[0]) for t, lp in zip(o.new_token_ids, o.new_logprobs, strict=True))
    assert core.num_kv_blocks_in_use() == 0
    return out


def forge(core: EngineCore, victim: list[int], from_rid_blocks: list[int], with_identity: bool) -> None:
    """Point the victim's second-block key at the attacker's second block, as a hash collision would."""
    kv = core.kv
    req = make_req("probe", victim)
    key = kv.block_hashes(req, 2)[1]
    block = kv.blocks[from_rid_blocks[1]]
    kv.cached[key] = block.block_id
    if with_identity:  # beyond any collision: also overwrite what the block says it was computed from
        block.identity = (kv.block_hashes(req, 1)[0], tuple(victim[BS : 2 * BS]), extra_keys(req, 1))


@pytest.mark.parametrize("with_identity", [False, True])
def test_forged_collision_cannot_change_output(tiny_model, with_identity) -> None:
    middle = [(11 * i + 5) % VOCAB for i in range(BS)]
    attacker = [*[(3 * i + 1) % VOCAB for i in range(BS)], *middle, 17]
    honest = [*[(5 * i + 2) % VOCAB for i in range(BS)], 23]
    victim = [*honest[:BS], *middle, 29]
    reference = run(make_core(tiny_model, prefix_caching=False), "v", victim)

    core = make_core(tiny_model, prefix_caching=True)
    run(core, "attacker", attacker)
    run(core, "honest", honest)  # the victim's first block is cached honestly
    attacker_blocks = [core.kv.cached[h] for h in core.kv.block_hashes(make_req("x", attacker), 2)]
    forge(core, victim, attacker_blocks, with_identity)
    before = core.scheduler.counters.prefix_cache_hit_tokens
    got = run(core, "v", victim)
    hit_tokens = core.scheduler.counters.prefix_cache_hit_tokens - before
    # Prefix caching changes GEMM shapes, so logprobs agree to float32 rounding, not bit for bit.
    drift = max(abs(a[1] - b[1]) for a, b in zip(got, reference, strict=True))
    if not with_identity:
        assert hit_tokens == BS  # the honest first block only
        assert [t for t, _ in got] == [t for t, _ in reference]
        assert drift < 1e-4
    else:
        # Control: had the forged block been accepted, the output would differ. This shows the test above
        # could fail; it is the state verification exists to refuse.
        assert hit_tokens == 2 * BS
        assert drift > 1e-2 or [t for t, _ in got] != [t for t, _ in reference]
