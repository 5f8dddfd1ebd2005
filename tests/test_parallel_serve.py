"""Tensor parallel behind a real `tokenmill serve`: the same tokens as one rank, a dead rank takes the
server down, and a leader + headless worker pair on loopback (the multi-node launch) serves too."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest_server import REPO, ServerProcess, free_port, wait_idle
from tiny_models import make_tiny_model
from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling_params import SamplingParams

PROMPT = "The three primary colors are"
MAX_TOKENS = 12


def _completion_tokens(server: ServerProcess, prompt: str = PROMPT) -> list[int]:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
              "logprobs": 0, "ignore_eos": True},
        timeout=300,
    )  # fmt: skip
    r.raise_for_status()
    return r.json()


def _reference_text(model: str | None, prompt: str = PROMPT) -> str:
    llm = LLM(model=model, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].text


def _rank_pids(parent: int) -> list[int]:
    """Worker ranks started (directly) by `parent`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"tokenmill.engine.parallel_worker" in cmd:
            pids.append(int(entry))
    return pids


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path


def _serve(log_dir, *args, model_name="m", env=None) -> ServerProcess:
    s = ServerProcess(
        "--served-model-name", model_name, "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
        "--max-model-len", "256", *args, log_dir=log_dir, env=env,
    )  # fmt: skip
    s.model = model_name
    return s


def test_tp3_server_answers_the_tokens_of_one_rank_and_frees_every_block(log_dir):
    server = _serve(log_dir, "--tensor-parallel-size", "3")
    try:
        server.wait_healthy()
        assert "KV cache per rank (tensor_parallel_size 3" in server.log()
        first = _completion_tokens(server)
        again = _completion_tokens(server)  # the whole prompt is a prefix hit now
        wait_idle(server)
        m = server.metrics()
        assert m["vllm:prefix_cache_hits_total"] > 0
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert first["choices"][0]["text"] == _reference_text(None)


def test_a_killed_rank_takes_the_server_down_with_errors_for_clients(tmp_path, log_dir):
    model = make_tiny_model(tmp_path, "llama")
    server = _serve(log_dir, "--model", str(model), "--tensor-parallel-size", "2")
    try:
        server.wait_healthy()
        ranks = _rank_pids(server.core_pid())
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPError):  # a refused connection or a 5xx, never a hang
            r = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "m", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True},
                timeout=60,
            )
            r.raise_for_status()
        server.proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        server.stop()
    assert server.proc.returncode != 0
    assert "parallel rank 1" in server.log() and "exited with code -9" in server.log()
    print(f"server exited {took:.1f}s after the rank was killed")


def test_leader_and_headless_worker_on_loopback_serve_the_tokens_of_one_process(tmp_path, log_dir):
    model = make_tiny_model(tmp_path, "llama")
    port = free_port()
    lws = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "127.0.0.1", "TOKENMILL_DIST_PORT": str(port)}
    leader = _serve(log_dir, "--model", str(model), "--tensor-parallel-size", "2",
                    env={**lws, "LWS_WORKER_INDEX": "0"})  # fmt: skip
    worker_log = open(log_dir / "worker.log", "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--headless", "--model", str(model),
         "--tensor-parallel-size", "2"],
        env={**os.environ, "OMP_NUM_THREADS": "1", **lws, "LWS_WORKER_INDEX": "1"},
        stdout=worker_log, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    try:
        leader.wait_healthy()
        assert _rank_pids(leader.core_pid()) == []  # its only other rank is on the "other node"
        text = _completion_tokens(leader)["choices"][0]["text"]
        wait_idle(leader)
    finally:
        leader.stop()
        try:
            worker.wait(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
            worker_log.close()
    assert leader.proc.returncode == 0
    assert worker.returncode == 0, (log_dir / "worker.log").read_text()
    assert text == _reference_text(str(model))
