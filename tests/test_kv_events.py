"""vLLM's KV-cache events from the engine: a subscriber that knows only the wire format
(tests/kv_events_subscriber.py: ZeroMQ + msgpack) rebuilds exactly the set of blocks the prefix cache
holds (the KVCacheManager's own hash map), through stores, hits, evictions, preemption and reset.

Two levels: the KVCacheManager under random operations, its records encoded as the publisher encodes
them (fast, hypothesis); and a real EngineCore on a tiny random Llama with the real ZeroMQ publisher, a
subscriber bound as llm-d's indexer binds (the engine connects), and the replay socket filling what the
subscriber missed before it was connected. The decoding is also checked field by field against how
llm-d's kv-cache indexer parses vLLM's events (its pkg/kvevents/engineadapter/vllm_adapter.go).
"""

import pathlib
import time

import msgpack
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, precondition, rule
from tokenmill.engine.config import EngineConfig, check_engine_config, parse_kv_events_config
from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.kv_events import build_events, encode_batch
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams

from tests.kv_events_subscriber import KVEventState, KVEventSubscriber
from tests.test_kv_cache_manager import BlockManagerMachine
from tests.tiny_models import make_tiny_model

BS = 16
VOCAB = 256


# ---- the configuration ---------------------------------------------------------------------------
def test_config_takes_vllms_json_and_defaults_the_publisher() -> None:
    c = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv@p@m"}')
    assert (c.publisher, c.endpoint, c.topic, c.replay_endpoint, c.buffer_steps) == (
        "zmq", "tcp://*:5557", "kv@p@m", None, 10_000,
    )  # fmt: skip
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert parse_kv_events_config(None) is None


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "endpoit": "tcp://*:1"}', "unknown field(s) ['endpoit']"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be 'zmq' or 'null'"),
        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm must be a positive integer"),
        ('{"enable_kv_cache_events": true, "buffer_steps": "9"}', "buffer_steps must be a positive integer"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
        ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint must be tcp://"),
    ],
)
def test_config_mistakes_name_the_field(raw: str, names: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_kv_events_config(raw)
    assert names in str(e.value)


def test_events_without_prefix_caching_are_refused() -> None:
    config = EngineConfig(enable_prefix_caching=False, kv_events_config={"enable_kv_cache_events": True})
    with pytest.raises(ValueError, match="need prefix caching"):
        check_engine_config(config)


def test_serve_refuses_a_bad_kv_events_config_before_starting(capsys) -> None:
    from tokenmill.engine.cli.serve import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "hwm": -1}'], environ={})
    assert e.value.code == 2
    assert "hwm must be a positive integer" in capsys.readouterr().err


def test_a_stored_event_names_the_adapter_and_carries_the_keys_its_hash_covers() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
    lora = LoRARequest("sql", 7, "/adapters/sql")
    req = Request("r", 0, list(range(9)), 9, SamplingParams(), 0.0, cache_salt="t", lora_request=lora)
    assert kv.allocate_slots(req, 9)
    req.num_computed_tokens = 9
    kv.cache_full_blocks(req)
    state = KVEventState()
    state.apply(encode_batch(time.time(), build_events(kv.take_events(), kv.block_size)))
    [event] = state.stored
    assert event[1] == kv.block_hashes(req, 2) and event[2] is None and event[3] == list(range(8))
    # lora_id, medium, lora_name; extra keys: the first block's (adapter id, salt), none on the second
    assert event[5:9] == [7, "GPU", "sql", [[7, "t"], None]]


# ---- the block manager's records, encoded as the publisher encodes them ---------------------------
class EventMachine(BlockManagerMachine):
    """The block manager's random operations (and reset), with events on: after every step the events
    encoded so far, decoded with msgpack alone, rebuild exactly the manager's hash map."""

    def __init__(self) -> None:
        super().__init__()
        self.kv.events = []  # as KVCacheManager(enable_kv_cache_events=True) starts
        self.state = KVEventState()

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self) -> None:
        assert self.kv.reset_prefix_cache()
        assert not self.kv.cached

    @precondition(lambda self: self.live)
    @rule()
    def reset_refused_while_blocks_are_held(self) -> None:
        before = dict(self.kv.cached)
        assert not self.kv.reset_prefix_cache()
        assert self.kv.cached == before

    @invariant()
    def events_rebuild_the_cache(self) -> None:
        records = self.kv.take_events()
        if records:
            self.state.apply(encode_batch(time.time(), build_events(records, self.kv.block_size)))
        assert self.state.blocks == set(self.kv.cached)


TestEvents = EventMachine.TestCase
TestEvents.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# ---- a real engine and a real subscriber ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", vocab_size=VOCAB)


def free_tcp() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_all(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, prompt, params, arrival_time=0.0, cache_salt=salt))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i) % VOCAB for i in range(n)]


@pytest.fixture(scope="module")
def engine_run(tiny_model):
    """One engine (12 blocks of 16 tokens, 4 sequences at a time) publishing to a subscriber; yields
    (core, subscriber, check) where check() brings the subscriber up to date and compares."""
    sub = KVEventSubscriber("tcp://127.0.0.1:0", bind=True, topic=b"kv@")
    replay = free_tcp()
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint, "replay_endpoint": replay,
        "topic": "kv@pod-0@tiny",
    }  # fmt: skip
    sub.replay_endpoint = replay
    try:
        core = EngineCore(EngineConfig(
            model=str(tiny_model), dtype="float32", device="cpu", block_size=BS, max_model_len=12 * BS,
            num_kv_blocks=12, max_num_seqs=4, kv_events_config=config,
        ))  # fmt: skip

        def check() -> None:
            assert core.kv_events.flush()
            sub.drain_until(core.kv_events.num_published)
            assert sub.blocks == set(core.kv.cached)

        try:
            yield core, sub, check
        finally:
            core.shutdown()
    finally:
        sub.close()


def test_engine_events_rebuild_the_prefix_cache(engine_run) -> None:
    core, sub, check = engine_run
    # Stores and hits: a shared 40-token prefix (two full blocks), four suffixes.
    system = prompt(1, 40)
    for i in range(4):
        add(core, f"s{i}", [*system, *prompt(10 + i, 9)], max_tokens=20)
    run_all(core)
    check()
    assert sub.counts["BlockStored"] > 0
    assert sub.replayed > 0  # the first batches went out before the subscription took: replayed

    # Evictions: prompts that together need more blocks than the pool has, one after another.
    for i in range(8):
        add(core, f"e{i}", prompt(100 + i, 50), max_tokens=4)
        run_all(core)
    check()
    assert sub.counts["BlockRemoved"] > 0

    # Preemption: four sequences that grow past what the pool holds together.
    before = core.stats()["num_preemptions"]
    for i in range(4):
        add(core, f"p{i}", prompt(200 + i, 30), max_tokens=40)
    run_all(core)
    assert core.stats()["num_preemptions"] > before
    check()

    # A salted prompt: its first block carries the salt as its extra key, the others none.
    add(core, "salted", prompt(300, 40), max_tokens=2, salt="tenant-a")
    run_all(core)
    check()
    salted = [e for e in sub.stored if e[3][:BS] == prompt(300, 40)[:BS] and e[2] is None]
    assert [e[8][:2] for e in salted] == [[["tenant-a"], None]]

    # Reset: refused while a request holds blocks (nothing published), done when idle.
    add(core, "running", prompt(400, 20), max_tokens=8)
    core.step()
    assert not core.reset_prefix_cache()
    run_all(core)
    check()
    assert core.kv.cached and sub.counts["AllBlocksCleared"] == 0
    assert core.reset_prefix_cache()
    check()
    assert sub.blocks == set() and sub.counts["AllBlocksCleared"] == 1
    assert core.num_kv_blocks_in_use() == 0
    assert sub.topics == {b"kv@pod-0@tiny"}  # later batches came live, under the configured topic


# ---- the decoding llm-d's indexer does ------------------------------------------------------------
def test_payloads_decode_as_llm_d_parses_vllm_events(engine_run) -> None:
    """Positions and types as llm-d-kv-cache's vLLM adapter reads them (vllm_adapter.go, msgpack arrays):
    batch [ts float64, events, dp rank]; BlockStored [tag, hashes, parent|nil, token ids (uint32),
    block size, lora id|nil, medium|nil, lora name|nil, extra keys|nil]; BlockRemoved [tag, hashes,
    medium|nil]. A hash is bin: llm-d keys it by its last 8 bytes, big-endian."""
    core, sub, check = engine_run
    if not sub.payloads:
        add(core, "decode", prompt(500, 40), max_tokens=2)
        run_all(core)
        check()
    assert sub.payloads
    for payload in sub.payloads:
        assert payload[0] == 0x93 and payload[1] == 0xCB  # fixarray of 3, then a float 64 (Go's float64)
        ts, events, dp_rank = msgpack.unpackb(payload, raw=True)  # raw: str and bin stay apart
        assert isinstance(ts, float) and dp_rank == 0
        for event in events:
            tag = event[0]
            assert isinstance(tag, bytes)  # msgpack str (raw=True gives its bytes): the tagged union
            if tag == b"BlockStored":
                assert 5 <= len(event) <= 12
                hashes, parent, tokens, block_size = event[1:5]
                keys = [int.from_bytes(h[-8:], "big") for h in hashes]  # getHashAsUint64
                assert len(set(keys)) == len(keys)
                assert parent is None or isinstance(parent, bytes)
                assert all(0 <= t < 2**32 for t in tokens) and block_size == BS
                lora_id, medium, lora_name, extra = event[5:9]
                assert lora_id is None and medium == b"GPU" and lora_name is None
                # extra_keys: one entry per block, nil or an array (ParseRawExtraKeys)
                assert len(extra) == len(hashes) and all(k is None or isinstance(k, list) for k in extra)
            elif tag == b"BlockRemoved":
                assert len(event) == 3 and all(isinstance(h, bytes) for h in event[1]) and event[2] == b"GPU"
            else:
                assert event == [b"AllBlocksCleared"]


def test_a_taken_endpoint_fails_startup_with_its_reason(tiny_model) -> None:
    sub = KVEventSubscriber("tcp://127.0.0.1:0", bind=True)
    taken = sub.endpoint.replace("127.0.0.1", "*")  # a wildcard binds, and this port is in use
    try:
        with pytest.raises(ValueError, match="cannot open endpoint"):
            EngineCore(EngineConfig(
                model=str(tiny_model), dtype="float32", device="cpu", max_model_len=12 * BS, num_kv_blocks=12,
                kv_events_config={"enable_kv_cache_events": True, "endpoint": taken},
            ))  # fmt: skip
    finally:
        sub.close()


def test_the_cost_benchmark_delivers_every_event_to_its_subscriber(capsys) -> None:
    """`python -m tokenmill.engine.bench.kv_events` (docs/serving.md) at a small scale: its subscriber
    process receives the events of every block the scheduler-only runs filled."""
    import re

    from tokenmill.engine.bench.kv_events import main

    main(["--skip-model", "--batch", "4", "--prompt-len", "32", "--max-tokens", "32", "--scheduler-rounds", "1"])
    out = capsys.readouterr().out
    events = int(re.search(r"the subscriber got \d+ batches, (\d+) events", out).group(1))
    # Two scheduler-only runs (on and off) of 4 prompts of 16-48 tokens plus 32 generated tokens: the
    # "on" run stores every full block it computes, one event per run of new blocks per sequence.
    assert events >= 4 and "x" in out
