"""Tensor and pipeline parallel through the offline API: the same greedy tokens as one rank, in fp32 on CPU.

Each parallel engine starts real worker processes (gloo on loopback). Tiny random models keep it cheap.
"""

import os
import pathlib
import threading

import numpy as np
import pytest
import torch
from conftest_server import free_port
from tiny_models import make_tiny_model
from tokenmill.engine import kv_memory
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.distributed.parallel_state import (
    kv_head_range,
    layer_range,
    validate_parallel,
    vocab_shard,
)
from tokenmill.engine.distributed.shm_broadcast import ShmRing
from tokenmill.engine.model_config import load_model_config
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.worker.step_input import StepInput, pack, unpack

# A rank's first forward (C++ kernels loading) can take a minute on a loaded 2-core machine.
COLLECTIVE_TIMEOUT_S = 300
PROMPTS = [
    [1, 5, 9, 200, 300, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
    [1, 5, 9, 200, 300, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 40, 41],  # a 16-token prefix hit
    [7, 8, 9, 10, 11],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp"), "qwen2", vocab_size=1000)  # qkv biases too


LONG_PROMPT = [(7 * i) % 990 + 3 for i in range(30)]  # longer than a step's 24 tokens: chunked prefill
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _generate(model: pathlib.Path, tp: int, pp: int) -> tuple[dict, dict, dict]:
    """One scenario through every feature the scheduler has: a greedy request with top-2 logprobs, a
    prefix hit, a seeded n=2 sampled request, a chunked prefill aborted after 3 tokens, and a pool of 8
    blocks of 16 that cannot hold every sequence (43 tokens, 3 blocks each): preemptions.
    Returns tokens and logprobs per (request, choice), and the engine's stats."""
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
        num_kv_blocks=8, max_model_len=64, max_num_batched_tokens=24, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )  # fmt: skip
    core = EngineCore(config)  # the core alone: prompts are token ids, no tokenizer needed
    later = [
        ("1", PROMPTS[1], SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=2, ignore_eos=True)),
        ("2", PROMPTS[2], GREEDY),
        ("3", LONG_PROMPT, GREEDY),
    ]
    tokens: dict[tuple[str, int], list[int]] = {}
    logprobs: dict[tuple[str, int], list] = {}
    try:
        core.add_request(_request("0", PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                  logprobs=2)))  # fmt: skip
        steps, aborted = 0, False
        while core.has_unfinished_requests():
            outputs, _ = core.step()
            steps += 1
            if steps == 1:  # the first prompt's full block is cached now: the second one hits it
                for rid, ids, params in later:
                    core.add_request(_request(rid, ids, params))
            for o in outputs:
                tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
                if o.new_logprobs is not None:
                    logprobs.setdefault((o.request_id, o.index), []).extend(o.new_logprobs)
            if len(tokens.get(("3", 0), [])) == 3 and not aborted:  # mid-decode, after its chunked prefill
                core.abort_requests(["3"])
                aborted = True
        stats = core.stats()
    finally:
        core.shutdown()
    return tokens, logprobs, stats


def _request(rid: str, ids: list[int], params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(rid, ids, params, 0.0, 0)


@pytest.fixture(scope="module")
def reference(tiny):
    return _generate(tiny, 1, 1)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_parallel_tokens_equal_one_rank_through_every_scheduler_feature(tiny, reference, tp, pp):
    ref_tokens, ref_logprobs, ref_stats = reference
    tokens, logprobs, stats = _generate(tiny, tp, pp)
    assert tokens == ref_tokens  # greedy, seeded n=2 sampling, and the aborted request's tokens so far
    for key, ref in ref_logprobs.items():  # the sampled token's logprob and the top 2 (ids, values)
        got = logprobs[key]
        assert len(got) == len(ref) == 24
        for (lp, top), (ref_lp, ref_top) in zip(got, ref, strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in ref_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-4)
    for s in (stats, ref_stats):
        assert s["kv_blocks_in_use"] == 0
        assert s["prefix_cache_hit_tokens"] >= 16
        assert s["num_preemptions"] > 0
    assert stats["num_preemptions"] == ref_stats["num_preemptions"]


def test_reference_run_is_not_trivial(reference):
    tokens, logprobs, _ = reference
    done = [t for key, t in tokens.items() if key[0] != "3"]
    assert len(done) == 4 and all(len(t) == 24 for t in done)  # requests 0, 1 (two choices), 2
    assert len({tuple(t) for t in done}) == len(done)  # the two seeded choices differ too
    assert len(tokens[("3", 0)]) == 3  # aborted after its prefill, mid-decode
    assert list(logprobs) == [("0", 0)]


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "2"], "tensor_parallel_size=2 does not divide the model's 9 attention heads; "
                                          "use one of [1, 3]"),
        (["--pipeline-parallel-size", "31"], "pipeline_parallel_size=31 is more than the model's 30 layers"),
        (["--tensor-parallel-size", "3", "--pipeline-parallel-size", "30", "--num-kv-blocks", "3"],
         "the KV cache holds 3 blocks"),
    ],
)  # fmt: skip
def test_serve_check_refuses_the_splits_the_engine_refuses(bundled_model_dir, capsys, argv, message):
    from tokenmill.engine.cli import serve as serve_cli

    assert serve_cli.main(["--check", "--model", str(bundled_model_dir), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tokenmill serve --check: error: ") and message in err[-1], err


def test_serve_check_sizes_the_pool_per_rank(bundled_model_dir, capsys):
    from tokenmill.engine.cli import serve as serve_cli

    argv = ["--check", "--model", str(bundled_model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256"]
    budget = kv_memory.kv_bytes_per_token(30, 3, 64, "float32", 3) * 16 * 100  # 100 blocks per rank at T=3
    assert serve_cli.main([*argv, "--tensor-parallel-size", "3", "--kv-cache-memory", str(budget)]) == 0
    line = capsys.readouterr().out.strip()
    assert "KV pool 100 blocks x 16 tokens = 1600 tokens per rank, tensor_parallel_size 3 x pipeline" in line
    assert serve_cli.main([*argv, "--kv-cache-memory", str(budget)]) == 0  # one rank holds 3 heads: a third
    assert "KV pool 33 blocks" in capsys.readouterr().out


def test_serve_refuses_ranks_that_do_not_split_over_the_nodes_while_parsing(capsys):
    from tokenmill.engine.cli import serve as serve_cli

    with pytest.raises(SystemExit) as e:
        serve_cli.main(["--check", "--tensor-parallel-size", "3", "--nnodes", "2"])
    assert e.value.code == 2
    assert "3 ranks (tensor_parallel_size=3 x pipeline_parallel_size=1) do not split evenly over 2 nodes" in (
        capsys.readouterr().err
    )


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


def test_shm_ring_carries_every_message_in_order_to_every_reader():
    ring = ShmRing.create(num_readers=2, chunk_bytes=8 * 64)
    readers = [ShmRing.attach(ring.path, 2, 8 * 64, i) for i in range(2)]  # separate mappings of the file
    ring.unlink()
    messages = [np.arange(i % 50 + 1, dtype=np.int64) * i for i in range(300)]
    got: list[list[np.ndarray]] = [[], []]

    def read(i: int) -> None:
        for _ in messages:
            got[i].append(readers[i].read().view(np.int64))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for m in messages:  # the writer waits for both readers whenever it laps them
        ring.write(m, timeout_s=60)
    for t in threads:
        t.join(60)
    for i in range(2):
        assert len(got[i]) == len(messages)
        assert all(np.array_equal(a, b) for a, b in zip(got[i], messages, strict=True))


def test_shm_ring_names_the_rank_that_does_not_read_and_refuses_what_does_not_fit():
    ring = ShmRing.create(num_readers=2, chunk_bytes=64)
    reader0 = ShmRing.attach(ring.path, 2, 64, 0)
    ring.unlink()
    for n in range(2):  # both chunks filled; reader 0 (rank 1) takes them, reader 1 (rank 2) never does
        ring.write(np.array([n], dtype=np.int64), timeout_s=1)
        reader0.read()
    with pytest.raises(TimeoutError, match=r"parallel ranks \[2\] did not take step message 1 within 0 s"):
        ring.write(np.array([2], dtype=np.int64), timeout_s=0.2)
    with pytest.raises(ValueError, match="a step of 72 bytes does not fit the 64-byte ring chunk"):
        ring.write(np.zeros(9, dtype=np.int64), timeout_s=1)


def test_liveness_connection_names_the_rank_and_shows_when_it_closes():
    import datetime
    import socket

    import torch.distributed as dist
    from tokenmill.engine.distributed import liveness

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    server = liveness.listen(store)
    try:
        stray = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        stray.sendall(b"hello there\n")
        with pytest.raises(ValueError, match=r"sent b'hello there\\n', not 'rank host pid'"):
            liveness.accept_one(server)
        conn = liveness.connect(store, "127.0.0.1", 5, timeout_s=30)
        remote = liveness.accept_one(server)
        host, pid = socket.gethostname(), os.getpid()
        assert remote.describe() == f"parallel rank 5 on host {host} (127.0.0.1, pid {pid})"
        assert not liveness.is_closed(remote.conn)
        conn.close()  # what the kernel does when the rank's process dies
        assert remote.conn.recv(1) == b""
        assert liveness.is_closed(remote.conn)
    finally:
        server.close()


def test_liveness_connection_that_cannot_reach_the_leader_says_where_it_dialled():
    import datetime

    import torch.distributed as dist
    from tokenmill.engine.distributed import liveness

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    closed = free_port()  # nothing listens there
    store.set(liveness.STORE_KEY, str(closed))
    message = f"rank 3 could not open its liveness connection to the leader at 127.0.0.1:{closed}"
    with pytest.raises(ConnectionError, match=message):
        liveness.connect(store, "127.0.0.1", 3, timeout_s=5)


def test_a_rank_that_just_died_is_logged_with_its_exit_code_while_the_watchdog_polls_it() -> None:
    # Popen.poll() answers None, without reaping, while another thread holds the Popen's wait lock, as
    # the rank watchdog does every 0.2 s: a step that failed right then logged the dead rank as "is
    # exited" without its code (seen in CI: test_parallel_serve's killed rank).
    import signal
    import subprocess
    import sys
    import time

    from tokenmill.engine.executor.multiproc import RankWatchdog

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watchdog = RankWatchdog({1: proc})
    watchdog.stop()  # no _die: this test reads what describe_ranks says
    proc.send_signal(signal.SIGKILL)
    held, release = threading.Event(), threading.Event()

    def hold_the_wait_lock() -> None:
        with proc._waitpid_lock:
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold_the_wait_lock)
    holder.start()
    held.wait(5)
    threading.Timer(0.5, release.set).start()
    try:
        for _ in range(100):  # until the kernel has made it a zombie: dead, not yet reaped
            if pathlib.Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.01)
        assert proc.poll() is None  # what the old code saw
        assert watchdog.describe_ranks() == f"parallel rank 1 (pid {proc.pid}) exited with code -9"
    finally:
        release.set()
        holder.join()
        proc.kill()
        proc.wait()


def test_a_rank_dying_just_after_the_failed_step_is_logged_with_its_exit_code() -> None:
    # A rank killed by a signal closes its sockets before it becomes a zombie, so the leader's collective
    # fails while the rank still runs: describe_ranks waits DEATH_GRACE_S for it (seen in CI: "is running").
    import subprocess
    import sys

    from tokenmill.engine.executor.multiproc import DEATH_GRACE_S, RankWatchdog

    proc = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watchdog = RankWatchdog({1: proc, 2: stuck})
    watchdog.stop()
    try:
        assert proc.poll() is None
        said = watchdog.describe_ranks()
        assert said.startswith(f"parallel rank 1 (pid {proc.pid}) exited with code 3; ")
        assert said.endswith(f"parallel rank 2 (pid {stuck.pid}) is sleeping")  # waited no longer than the grace
        assert DEATH_GRACE_S <= 2
    finally:
        for p in (proc, stuck):
            p.kill()
            p.wait()
