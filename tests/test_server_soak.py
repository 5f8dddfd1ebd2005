"""A bounded soak against a real `tokenmill serve` on loopback (tiny random Llama): streamed and
non-streamed completions and chats, n > 1, clients that disconnect mid-stream at random points, clients
that give up on a non-streamed request before its answer (the server must abort it in the engine), and a
KV pool so small that the scheduler preempts all the time.

At the end: zero KV blocks in use and nothing running or waiting (the real gauges, read from /metrics),
the server's RSS (API process + engine core) grew by a bounded amount after warm-up, no request outlived
its deadline, every answer read to the end was well formed, and the server still answers /health.
SOAK_SECONDS sets the length (the suite runs a short one; `make soak` a long one).
"""

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest
from conftest_server import serving, wait_idle
from tiny_models import make_tiny_model

MODEL = "tiny"
SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "45"))
CONCURRENCY = 12
DEADLINE_S = 180.0  # no request may take longer, even on a loaded two-core machine
# 20 blocks x 16 tokens = 320 tokens for up to 6 sequences of up to 256: preemption on every burst.
MAX_MODEL_LEN = 256
POOL = ("--num-kv-blocks", "20", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "6")
MAX_TOKENS = 160  # with the longest prompt below (~60 words + the chat template) still under MAX_MODEL_LEN
RSS_GROWTH_LIMIT = 1.30  # end RSS over warm RSS, API + core together


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    yield from serving(
        "--model", str(model), "--served-model-name", MODEL, *POOL, "--dtype", "float32",
        "--max-waiting-requests", "0", "--disable-access-log", log_dir=tmp_path_factory.mktemp("serve"),
    )  # fmt: skip


@dataclass
class Tally:
    complete: int = 0
    streamed: int = 0
    with_n: int = 0  # completed with n > 1
    gave_up: int = 0  # non-streamed, the client's timeout hit before the answer
    disconnected: int = 0  # streamed, the client closed the connection mid-stream
    hung: int = 0  # past DEADLINE_S
    hung_seen: list[str] = field(default_factory=list)  # what each hung request was, and the server's gauges then
    latencies: list[float] = field(default_factory=list)


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def check_usage(usage: dict, n: int, max_tokens: int) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert n <= usage["completion_tokens"] <= n * max_tokens, usage


def check_final(body: dict, n: int, chat: bool, max_tokens: int) -> None:
    assert body["object"] == ("chat.completion" if chat else "text_completion") and body["model"] == MODEL, body
    assert sorted(c["index"] for c in body["choices"]) == list(range(n)), body
    for c in body["choices"]:
        assert c["finish_reason"] in ("stop", "length"), c
        assert isinstance(c["message"]["content"] if chat else c["text"], str), c
    check_usage(body["usage"], n, max_tokens)


def check_stream(lines: list[str], n: int, chat: bool, max_tokens: int) -> None:
    events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", lines[-3:]
    finished: set[int] = set()
    usage = None
    for e in events[:-1]:
        chunk = json.loads(e)
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"), chunk
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            assert 0 <= c["index"] < n and c["index"] not in finished, (c, finished)  # nothing after finish
            if c.get("finish_reason"):
                assert c["finish_reason"] in ("stop", "length"), c
                finished.add(c["index"])
    assert finished == set(range(n)), finished
    assert usage is not None, "stream_options.include_usage was set"
    check_usage(usage, n, max_tokens)


def make_body(rng: random.Random, chat: bool, stream: bool) -> tuple[str, dict]:
    body: dict = {
        "model": MODEL, "n": rng.choice([1, 1, 2, 3]), "stream": stream, "max_tokens": rng.randint(4, MAX_TOKENS),
        "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1000), "ignore_eos": rng.random() < 0.5,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    # Few distinct words, so prompts share prefixes and the prefix cache gets hits across preemptions.
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "story", "time"]) for _ in range(rng.randint(1, 60)))
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
        return "/v1/chat/completions", body
    body["prompt"] = words
    return "/v1/completions", body


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, tally: Tally, stream: bool, fate: float
) -> None:
    """Non-streamed: given up on when fate < 0.2. Streamed: cut after a few lines when fate < 0.35."""
    chat = rng.random() < 0.5
    path, body = make_body(rng, chat, stream)
    n, max_tokens = body["n"], body["max_tokens"]
    if not stream:
        if fate < 0.2:  # give up early: the server sees the disconnect and must abort the request
            try:
                r = await client.post(path, json=body, timeout=rng.uniform(0.05, 1.0))
            except httpx.TimeoutException:
                tally.gave_up += 1
                return
        else:
            r = await client.post(path, json=body, timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
        check_final(r.json(), n, chat, max_tokens)
    else:
        cut_after = rng.randint(1, 20) if fate < 0.35 else None
        async with client.stream("POST", path, json=body, timeout=DEADLINE_S) as r:
            assert r.status_code == 200, await r.aread()
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if cut_after is not None and len(lines) >= cut_after:
                    tally.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
        check_stream(lines, n, chat, max_tokens)
        tally.streamed += 1
    tally.complete += 1
    tally.with_n += n > 1


async def describe_hang(client: httpx.AsyncClient, rng_state: tuple, stream: bool, fate: float) -> str:
    """The hung request's body (replayed from the worker's random state) and the engine's gauges now."""
    rng = random.Random()
    rng.setstate(rng_state)
    chat = rng.random() < 0.5
    _, body = make_body(rng, chat, stream)
    body.pop("messages", None), body.pop("prompt", None)
    gauges = {}
    try:
        text = (await client.get("/metrics", timeout=10)).text
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
                gauges[name] = float(line.rsplit(" ", 1)[1])
    except httpx.HTTPError as e:
        gauges["error"] = repr(e)
    return f"fate {fate:.2f} {body} gauges {gauges}"


async def soak(url: str, seconds: float, on_warm) -> Tally:
    tally = Tally()
    start = time.monotonic()
    stop_at, warm_at = start + seconds, start + seconds * 0.25
    warm_done = False
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def worker(seed: int) -> None:
            nonlocal warm_done
            rng = random.Random(seed)
            first = True
            while time.monotonic() < stop_at:
                stream, fate = rng.random() < 0.6, rng.random()
                if first and seed < 2:  # however short the soak: at least one of each kind of abort
                    stream, fate = seed == 1, 0.0
                first = False
                t0 = time.monotonic()
                rng_state = rng.getstate()
                try:
                    await asyncio.wait_for(one_request(client, rng, tally, stream, fate), DEADLINE_S)
                except TimeoutError:
                    tally.hung += 1
                    tally.hung_seen.append(await describe_hang(client, rng_state, stream, fate))
                tally.latencies.append(time.monotonic() - t0)
                if not warm_done and time.monotonic() >= warm_at:
                    warm_done = True
                    on_warm()

        await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    return tally


def test_soak_mixed_traffic_with_disconnects_and_preemption(server):
    pids = [server.proc.pid, server.core_pid()]
    warm: list[int] = []
    preempt_before = server.metrics().get("vllm:num_preemptions_total", 0.0)
    t0 = time.monotonic()
    tally = asyncio.run(soak(server.url, SOAK_SECONDS, lambda: warm.append(rss_bytes(pids))))
    wall = time.monotonic() - t0
    wait_idle(server, timeout_s=120)  # zero KV blocks in use (vllm:kv_cache_usage_perc), nothing running
    end = rss_bytes(pids)
    m = server.metrics()
    preemptions = m["vllm:num_preemptions_total"] - preempt_before
    print(
        f"\nsoak {SOAK_SECONDS:.0f} s (wall {wall:.0f} s): {len(tally.latencies)} requests, {tally.complete} complete "
        f"({tally.streamed} streamed, {tally.with_n} with n > 1), {tally.disconnected} disconnected mid-stream, "
        f"{tally.gave_up} given up before the answer, {tally.hung} hung; slowest {max(tally.latencies):.1f} s; "
        f"preemptions {preemptions:.0f}; RSS warm {warm[0] / 2**20:.0f} MiB -> end {end / 2**20:.0f} MiB"
    )
    assert tally.hung == 0, (tally.hung_seen, server.log()[-20000:])
    assert tally.complete > 0 and tally.disconnected > 0 and tally.gave_up > 0, tally
    assert preemptions > 0, "the pool was meant to force preemption"
    assert m["vllm:num_requests_waiting"] == 0
    assert end <= warm[0] * RSS_GROWTH_LIMIT, (warm[0], end)
    assert server.proc.poll() is None and httpx.get(f"{server.url}/health").status_code == 200
