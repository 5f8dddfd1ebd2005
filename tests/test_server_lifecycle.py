"""Overload, graceful shutdown, engine death and startup failure, each against a real `tokenmill serve`
process. These behaviours do not depend on what the model says, so the servers run a tiny random
Llama (real weights in a real HF folder, the bundled tokenizer) that loads in a moment; the bundled
model's answers are tested in test_server_openai.py.

Three servers start together (startup dominates the runtime): A serves the overload test and then is
shut down with SIGTERM mid-stream; B loses its engine core to SIGKILL; C cannot fit its KV cache.
"""

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest_server import ServerProcess, wait_idle
from tiny_models import make_tiny_model

API_KEY = "lifecycle-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"
GRACE_S = 120  # far longer than the stream needs: the test proves the stream was waited for, not cut


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    logs = tmp_path_factory.mktemp("serve")
    common = ("--model", str(model), "--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks",
              "128", "--dtype", "float32")  # fmt: skip
    a = ServerProcess(
        *common, "--max-waiting-requests", "2", "--max-num-seqs", "2", "--shutdown-grace-period", str(GRACE_S),
        "--require-auth-for-metrics", env={"TOKENMILL_API_KEY": API_KEY}, log_dir=logs,
    )  # fmt: skip
    b = ServerProcess(*common, log_dir=logs)
    # 4 blocks x 16 tokens cannot hold one 512-token sequence: startup must fail, clearly
    c = ServerProcess("--model", str(model), "--max-model-len", "512", "--num-kv-blocks", "4", log_dir=logs)
    try:
        first_health = a.first_health()
        a.wait_healthy()
        b.wait_healthy()
        yield {"a": a, "b": b, "c": c, "a_first_health": first_health}
    finally:
        for s in (a, b, c):
            s.stop()


def test_health_is_503_while_loading_then_200(servers):
    first = servers["a_first_health"]
    assert first.status_code == 503 and first.json()["status"] == "loading"
    assert httpx.get(f"{servers['a'].url}/health").status_code == 200
    assert "KV cache: 128 blocks x 16 tokens = 2048 tokens" in servers["a"].log()  # the capacity line


def test_startup_error_is_reported_and_exits_nonzero(servers):
    c = servers["c"]
    assert c.proc.wait(300) == 1
    log = c.log()
    assert "startup failed" in log
    assert "4 blocks x 16 tokens = 64 tokens" in log and "max_model_len=512" in log


def test_metrics_can_require_the_api_key(servers):
    a = servers["a"]
    r = httpx.get(f"{a.url}/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{a.url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{a.url}/health").status_code == 200  # probes never need the key


def test_overload_burst_gets_429_with_retry_after_and_admitted_complete(servers):
    a = servers["a"]
    max_tokens = 64

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": max_tokens, "ignore_eos": True}
        return await client.post("/v1/completions", json=body)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=a.url, headers=AUTH, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 16, [r.status_code for r in responses]
    assert refused, "a burst of 16 against --max-waiting-requests 2 / --max-num-seqs 2 must see 429s"
    assert len(ok) >= 2
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "--max-waiting-requests 2" in err["message"]
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == max_tokens
    wait_idle(a, headers=AUTH)
    m = a.metrics(AUTH)
    assert m["vllm:num_requests_waiting"] == 0


def test_sigterm_during_stream_finishes_the_stream_then_exits_zero(servers):
    a = servers["a"]
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=480, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)
    a.proc.send_signal(signal.SIGTERM)
    # Short: the tiny model streams fast, and the server exits as soon as the stream is done.
    time.sleep(0.05)
    # draining: no new work, health says so (Kubernetes stops routing), the stream goes on
    assert httpx.get(f"{a.url}/health").status_code == 503
    r = httpx.post(f"{a.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    rest = list(chunks)
    usage = rest[-1].usage
    assert usage is not None and usage.completion_tokens == 480
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert a.proc.wait(60) == 0, a.log()
    assert "drained" in a.log()


def test_engine_core_death_fails_in_flight_fast_and_exits_nonzero(servers):
    b = servers["b"]
    client = openai.OpenAI(base_url=f"{b.url}/v1", api_key="unused", max_retries=0, timeout=120)
    results: dict[str, object] = {}

    def non_streamed() -> None:
        try:
            client.completions.create(
                model=MODEL, prompt="Tell me", max_tokens=480, extra_body={"ignore_eos": True}
            )
            results["plain"] = "completed"
        except openai.APIStatusError as e:
            results["plain"] = e
        results["plain_at"] = time.monotonic()

    def streamed() -> None:
        try:
            for _ in client.completions.create(
                model=MODEL,
                prompt="Tell me more",
                max_tokens=480,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                pass
            results["stream"] = "completed"
        except openai.APIError as e:
            results["stream"] = e

    threads = [threading.Thread(target=non_streamed), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    b.wait_metric("vllm:num_requests_running", lambda v: v == 2, timeout_s=60)
    health: list[int | str] = []
    stop_polling = threading.Event()

    def poll_health() -> None:
        while not stop_polling.is_set():
            try:
                health.append(httpx.get(f"{b.url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                health.append("down")
            time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    core = b.core_pid()
    killed_at = time.monotonic()
    os.kill(core, signal.SIGKILL)
    for t in threads:
        t.join(30)
    exit_code = b.proc.wait(30)
    stop_polling.set()
    poller.join()

    plain = results["plain"]
    assert isinstance(plain, openai.InternalServerError), plain
    assert plain.status_code == 500
    assert "engine" in plain.body["message"] and "SIGKILL" in plain.body["message"]
    assert results["plain_at"] - killed_at < 5.0  # fails fast, no hung client
    assert isinstance(results["stream"], openai.APIError) and "SIGKILL" in str(results["stream"])
    # health turned 503 once the core was gone, before the process went away
    assert 503 in health, health
    assert 200 not in health[health.index(503) :], health  # and never healthy again
    assert exit_code != 0
    assert "engine core died" in b.log()
