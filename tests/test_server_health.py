"""Health that tells the truth, against a real `tokenmill serve` whose engine core is stopped, resumed
and killed: /health (readiness) turns 503 once the core makes no progress with a request in it and 200
again when it resumes; /live (liveness) turns 503 only after the longer bound; a dead core is 503 and a
non-zero exit. Bounds are short here (2 s / 4 s) so the test waits little; no assertion times anything.
"""

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest_server import ServerProcess
from tiny_models import make_tiny_model

MODEL = "tiny"
READY_S, LIVE_S = 2, 4
WAIT_S = 120  # generous: the shared machine may be slow, and only the eventual state is asserted


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    s = ServerProcess(
        "--model", str(model), "--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "64",
        "--dtype", "float32", "--readiness-stall-seconds", str(READY_S), "--liveness-stall-seconds", str(LIVE_S),
        log_dir=tmp_path_factory.mktemp("serve"),
    )  # fmt: skip
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def wait_status(url: str, code: int) -> httpx.Response:
    deadline = time.monotonic() + WAIT_S
    r = None
    while time.monotonic() < deadline:
        r = httpx.get(url, timeout=5)
        if r.status_code == code:
            return r
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {code}; last: {r.status_code if r else None} {r.text if r else ''}")


def test_stopped_core_fails_readiness_then_liveness_and_recovers(server):
    health, live = f"{server.url}/health", f"{server.url}/live"
    assert httpx.get(live).status_code == 200
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    first_chunk = threading.Event()
    result: dict[str, object] = {}

    def stream() -> None:
        try:
            tokens = 0
            for chunk in client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
            ):  # fmt: skip
                first_chunk.set()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            result["tokens"] = tokens
        except Exception as e:
            result["error"] = e
            first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(WAIT_S) and "error" not in result, result
    core = server.core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        r = wait_status(health, 503)
        body = r.json()
        assert body["status"] == "stalled" and "no progress" in body["detail"], body
        assert f"bound {READY_S}s" in body["detail"]
        r = wait_status(live, 503)
        assert r.json()["status"] == "stalled" and f"bound {LIVE_S}s" in r.json()["detail"]
    finally:
        os.kill(core, signal.SIGCONT)
    wait_status(health, 200)
    assert httpx.get(live).status_code == 200
    t.join(WAIT_S)
    assert result.get("tokens") == 400, result  # the stalled request was not lost
    # Idle is not a stall: with nothing in the core, time without steps keeps both probes at 200.
    time.sleep(LIVE_S + 1)
    assert httpx.get(health).status_code == 200 and httpx.get(live).status_code == 200


def test_killed_core_fails_both_probes_and_exits_nonzero(server):
    os.kill(server.core_pid(), signal.SIGKILL)
    seen: dict[str, list[int]] = {"health": [], "live": []}
    while server.proc.poll() is None:
        try:
            for probe in seen:
                seen[probe].append(httpx.get(f"{server.url}/{probe}", timeout=2).status_code)
        except httpx.HTTPError:
            break
        time.sleep(0.02)
    assert server.proc.wait(60) != 0
    # The process exits about 1 s after the death; a loaded machine may answer only a few probes first.
    assert 503 in seen["health"] + seen["live"], seen
    for codes in seen.values():
        if 503 in codes:
            assert 200 not in codes[codes.index(503) :], seen  # never healthy again
    assert "engine core died" in server.log()


def test_probe_answers_for_each_server_state() -> None:
    """The decision table without a server (the real-server tests above cover stall and death)."""
    from tokenmill.engine.server.health import HealthConfig, liveness, readiness
    from tokenmill.engine.server.state import ServerState

    cfg = HealthConfig(readiness_stall_s=READY_S, liveness_stall_s=LIVE_S)
    expected = {"loading": (503, 200), "ready": (200, 200), "draining": (503, 200), "dead": (503, 503),
                "failed": (503, 503)}  # fmt: skip
    for status, codes in expected.items():
        state = ServerState(served_model_names=["m"], status=status)
        assert (readiness(state, cfg).status_code, liveness(state, cfg).status_code) == codes, status
