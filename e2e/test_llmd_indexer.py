"""llm-d's KV-cache indexer, its own code (e2e/llmd_indexer_check, built inside llm-d-kv-cache v0.8.1 by
e2e/build_llmd_indexer_check.sh), fed by a real `tokenmill serve` process's KV-cache events: its ZeroMQ
subscriber binds as the global indexer socket does, the engine connects (--kv-events-config with the
topic kv@<pod>@<model>), and its vLLM adapter, event pool and in-memory index take the events. Looked up
by llm-d's own request keys (computed from a prompt's tokens, as its precise prefix-cache scorer does),
the index names the engine's pod for the blocks the engine holds, and no longer once they are evicted.
No cluster: the engine is a tiny random Llama with the bundled tokenizer (the events do not depend on
what the model says).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from cluster import REPO, free_port
from engines import Process

HERE = Path(__file__).resolve().parent
MODEL = "tiny"
POD = "pod-a"
BS = 16


@pytest.fixture(scope="module")
def indexer(tmp_path_factory):
    build = subprocess.run(["bash", str(HERE / "build_llmd_indexer_check.sh")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path_factory.mktemp("indexer") / "indexer.log", "wb")
    proc = subprocess.Popen([build.stdout.strip().splitlines()[-1], endpoint, str(BS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        yield proc, endpoint
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, indexer):
    from tokenmill.engine.model.resolve import resolve_model

    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", tokenizer_dir=resolve_model(None))
    config = {"enable_kv_cache_events": True, "endpoint": indexer[1], "topic": f"kv@{POD}@{MODEL}"}
    port = free_port()
    argv = [str(REPO / ".venv" / "bin" / "tokenmill"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(model), "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
            "--num-kv-blocks", "24", "--kv-events-config", json.dumps(config), "--disable-access-log"]  # fmt: skip
    proc = Process(argv, tmp_path_factory.mktemp("engine") / "engine.log", env={"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(f"{url}/health", f"tokenmill serve on port {port}", 300)
    try:
        yield url
    finally:
        proc.stop()


def pods(indexer, tokens: list[int], extra: list | None = None) -> list[list[str]]:
    """The pods llm-d's index holds for each full block of tokens (extra: each block's extra keys)."""
    proc = indexer[0]
    proc.stdin.write(json.dumps({"model": MODEL, "tokens": tokens, "extra": extra}) + "\n")
    proc.stdin.flush()
    answer = json.loads(proc.stdout.readline())
    assert "error" not in answer, answer
    return answer["pods"]


def complete(url: str, tokens: list[int], **extra) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": tokens, "max_tokens": 2, "temperature": 0, **extra})  # fmt: skip
    assert r.status_code == 200, r.text


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 40000 + 10 for i in range(n)]


def wait_for(indexer, tokens: list[int], want: list[list[str]], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    got = pods(indexer, tokens)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.2)
        got = pods(indexer, tokens)
    assert got == want


def test_llm_d_indexes_the_engines_blocks_and_forgets_evicted_ones(indexer, engine) -> None:
    first = prompt(1, 3 * BS + 5)
    complete(engine, first)
    wait_for(indexer, first, [[POD]] * 3)
    assert pods(indexer, prompt(2, 3 * BS)) == [[], [], []]  # never sent: no pod

    # A prefix shared by two prompts is indexed once, for the blocks both hold.
    second = [*first[: 2 * BS], *prompt(3, BS + 7)]
    complete(engine, second)
    wait_for(indexer, second, [[POD]] * 3)

    # Evictions: 24 blocks, prompts of 4 full blocks each, until the first prompt's blocks are reused.
    for seed in range(10, 20):
        complete(engine, prompt(seed, 4 * BS + 1))
    wait_for(indexer, prompt(19, 4 * BS + 1), [[POD]] * 4)
    wait_for(indexer, first, [[], [], []])


def test_a_salted_prefix_is_not_routable_by_llm_d(indexer, engine) -> None:
    """The salt travels in the first block's extra keys, as vLLM sends it; llm-d 0.8.1 reads a string there
    as a multimodal hash, so its request keys for the plain tokens never match: a tenant's salted
    prefix is not steered by prefix affinity (with vLLM engines alike). Looked up with the salt as that
    block's extra key, it is there: the event was read, salt and all."""
    salted = prompt(40, 2 * BS + 3)
    complete(engine, salted, cache_salt="tenant-a")
    unsalted_marker = prompt(41, BS + 1)
    complete(engine, unsalted_marker)  # sent after: once it is indexed, the salted one was processed
    wait_for(indexer, unsalted_marker, [[POD]])
    assert pods(indexer, salted) == [[], []]
    assert pods(indexer, salted, extra=[["tenant-a"], None]) == [[POD], [POD]]
