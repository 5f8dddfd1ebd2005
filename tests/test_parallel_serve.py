"""Tensor parallel behind real `tokenmill serve` processes, driven by the official `openai` client.

- T=3 on the bundled model (9 heads, 3 KV heads: one KV head per rank) answers the tokens of one rank,
  with a prefix hit, and frees every block.
- A leader and a separately started `tokenmill serve --headless` worker, wired by the LeaderWorkerSet
  env on loopback (the multi-node launch), answer the tokens of one process; only the leader serves HTTP.
- A SIGKILLed rank and a SIGSTOPped (hung) rank each take the server down with a non-zero exit and a
  log line naming the rank, and a streaming request in flight ends with an error instead of hanging.
- A SIGKILLed headless worker takes the leader down too, idle or streaming, with a line naming the rank
  and its host.

Every server here starts T processes; the module keeps them few and uses tiny models where it can.
"""

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from conftest_server import REPO, ServerProcess, free_port, wait_idle
from tiny_models import make_tiny_model
from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling_params import SamplingParams

PROMPT = "The three primary colors are"
# Two full blocks of 16 tokens and more: the second request of it hits the prefix cache.
LONG_PROMPT = (
    "A rainbow shows the colors of visible light in order: red, orange, yellow, green, blue, indigo and "
    "violet. The three primary colors are"
)
MAX_TOKENS = 12
# The hung-rank test: a collective waits this long before the step fails (docs/engine.md, "Failure");
# not less, since a rank's first forward (C++ kernels loading) takes seconds on a loaded machine.
HANG_TIMEOUT_S = 30
# The other servers: a first forward under a load average of 20 must not count as a hang.
COLLECTIVE_TIMEOUT_S = 300
# Bounds for "does not hang" and for start-up: generous for a loaded 2-core machine (T+1 processes
# import torch at once); they only catch a real hang.
EXIT_WAIT_S = 120
STARTUP_S = 900


def _client(server: ServerProcess, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def _greedy_text(server: ServerProcess, model: str, prompt: str = PROMPT) -> str:
    r = _client(server).completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def _reference_text(model: str | None, prompt: str = PROMPT) -> str:
    """The same request through the offline API on one rank."""
    llm = LLM(model=model, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def _rank_pids(parent: int) -> list[int]:
    """Worker ranks started directly by `parent`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"tokenmill.engine.worker.rank_main" in cmd:
            pids.append(int(entry))
    return pids


def _serve(log_dir, *args: str, env: dict | None = None) -> ServerProcess:
    timeout = [] if "--collective-timeout" in args else ["--collective-timeout", str(COLLECTIVE_TIMEOUT_S)]
    return ServerProcess(
        "--served-model-name", "m", "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
        "--max-model-len", "256", *timeout, *args, log_dir=log_dir, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp-serve"), "llama")  # 4 heads, 2 KV heads, 2 layers


@pytest.fixture(scope="module")
def tiny_reference(tiny) -> str:
    return _reference_text(str(tiny))


def test_tp3_server_answers_the_tokens_of_one_rank_and_frees_every_block(tmp_path):
    server = _serve(tmp_path, "--tensor-parallel-size", "3")
    try:
        server.wait_healthy(STARTUP_S)
        assert "KV cache per rank (tensor_parallel_size 3" in server.log()
        assert len(_rank_pids(server.core_pid())) == 2
        first = _greedy_text(server, "m", LONG_PROMPT)
        again = _greedy_text(server, "m", LONG_PROMPT)  # the prompt's full blocks are prefix hits now
        wait_idle(server)
        hits = server.metrics()["vllm:prefix_cache_hits_total"]
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log()
    assert hits > 0
    assert first == again
    assert first == _reference_text(None, LONG_PROMPT)


def _leader_and_worker(tiny, tmp_path) -> tuple[ServerProcess, subprocess.Popen, object]:
    """A leader `tokenmill serve` and a `--headless` worker wired by the LeaderWorkerSet env on loopback:
    (leader, worker process, the worker's open log file)."""
    port = free_port()
    lws = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    leader = _serve(tmp_path, "--model", str(tiny), "--tensor-parallel-size", "2", "--dist-port", str(port),
                    env={**lws, "LWS_WORKER_INDEX": "0"})  # fmt: skip
    worker_log = open(tmp_path / "worker.log", "wb")
    # The worker gets no --port: a headless node serves no HTTP (asserted below by the leader's port
    # being the only one answering and by the worker's log).
    worker = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli.main", "serve", "--headless", "--model", str(tiny),
         "--tensor-parallel-size", "2", "--dist-port", str(port), "--collective-timeout", str(COLLECTIVE_TIMEOUT_S)],
        env={**os.environ, "OMP_NUM_THREADS": "1", **lws, "LWS_WORKER_INDEX": "1"},
        stdout=worker_log, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    return leader, worker, worker_log


def test_leader_and_headless_worker_on_loopback_serve_the_tokens_of_one_process(tiny, tiny_reference, tmp_path):
    leader, worker, worker_log = _leader_and_worker(tiny, tmp_path)
    worker_log_path = tmp_path / "worker.log"
    try:
        leader.wait_healthy(STARTUP_S)
        assert _rank_pids(leader.core_pid()) == []  # its only other rank is on the "other node"
        assert len(_rank_pids(worker.pid)) == 1
        text = _greedy_text(leader, "m")
        wait_idle(leader)
    finally:
        leader.stop()
        try:
            worker.wait(timeout=EXIT_WAIT_S)
        finally:
            if worker.poll() is None:
                worker.kill()
            worker_log.close()
    worker_out = worker_log_path.read_text(errors="replace")
    assert leader.proc.returncode == 0, leader.log()
    assert worker.returncode == 0, worker_out
    assert "headless worker node 1: ranks 1-1, leader 127.0.0.1" in worker_out
    assert "Uvicorn running" not in worker_out and "ready: serving" not in worker_out
    assert text == tiny_reference


def _stream_until_broken(server: ServerProcess, box: dict) -> None:
    """A long streaming completion; records how it ended (an exception is the expected end)."""
    try:
        stream = _client(server, timeout=EXIT_WAIT_S).completions.create(
            model="m", prompt=PROMPT, max_tokens=200, stream=True, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            box.setdefault("chunks", 0)
            box["chunks"] += 1
            box["started"].set()
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                box["finish_reason"] = chunk.choices[0].finish_reason
        box["end"] = "stream ended"
    except (openai.APIError, httpx.HTTPError) as e:
        box["end"] = f"error: {type(e).__name__}: {e}"
    finally:
        box["started"].set()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_rank_takes_the_server_down_and_fails_the_request_in_flight(tiny, tmp_path, sig):
    server = _serve(tmp_path, "--model", str(tiny), "--tensor-parallel-size", "2",
                    "--collective-timeout", str(HANG_TIMEOUT_S))  # fmt: skip
    try:
        server.wait_healthy(STARTUP_S)
        (rank_pid,) = _rank_pids(server.core_pid())
        box: dict = {"started": threading.Event()}
        reader = threading.Thread(target=_stream_until_broken, args=(server, box), daemon=True)
        reader.start()
        assert box["started"].wait(EXIT_WAIT_S), "the stream never produced a chunk"
        os.kill(rank_pid, sig)
        reader.join(EXIT_WAIT_S)
        assert not reader.is_alive(), "the in-flight request hangs"
        server.proc.wait(timeout=EXIT_WAIT_S)
    finally:
        try:
            os.kill(rank_pid, signal.SIGKILL)  # a stopped rank the server failed to reap
        except (ProcessLookupError, UnboundLocalError):
            pass
        server.stop()
    log = server.log()
    assert server.proc.returncode != 0, log
    # A stream that was cut shows up as an error or a stream that ended without a finish_reason.
    assert box["end"].startswith("error") or "finish_reason" not in box, box
    if sig == signal.SIGKILL:
        assert f"parallel rank 1 (pid {rank_pid}) exited with code -9" in log, log
    else:
        assert f"parallel rank 1 (pid {rank_pid}) is stopped" in log, log


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "streaming"])
def test_a_dead_worker_node_takes_the_leader_down_naming_the_rank_and_its_host(tiny, tmp_path, busy):
    """SIGKILL of the headless worker (its rank follows within 0.5 s): the leader, idle or streaming,
    exits non-zero with a line naming rank 1 and its host, from its liveness connection (an idle
    leader has no collective in flight that could fail)."""
    leader, worker, worker_log = _leader_and_worker(tiny, tmp_path)
    box: dict = {"started": threading.Event()}
    try:
        leader.wait_healthy(STARTUP_S)
        (rank_pid,) = _rank_pids(worker.pid)
        if busy:
            reader = threading.Thread(target=_stream_until_broken, args=(leader, box), daemon=True)
            reader.start()
            assert box["started"].wait(EXIT_WAIT_S), "the stream never produced a chunk"
        worker.kill()
        leader.proc.wait(timeout=EXIT_WAIT_S)
        if busy:
            reader.join(EXIT_WAIT_S)
            assert not reader.is_alive(), "the in-flight request hangs"
    finally:
        try:
            os.kill(rank_pid, signal.SIGKILL)  # if it outlived its launcher
        except (ProcessLookupError, UnboundLocalError):
            pass
        worker.kill()
        worker.wait()
        worker_log.close()
        leader.stop()
    log = leader.log()
    assert leader.proc.returncode != 0, log
    named = f"parallel rank 1 on host {socket.gethostname()} (127.0.0.1, pid {rank_pid}) closed its connection"
    assert named in log, log
    if busy:
        assert box["end"].startswith("error") or "finish_reason" not in box, box
