"""The endpoint picker's own code reads a real engine's /metrics: e2e/epp_metrics_check (built inside the
EPP v1.5.0 module by e2e/build_epp_metrics_check.sh) scrapes `tokenmill serve` with the EPP's HTTP
data source, parses it with the EPP's Prometheus parser and runs the EPP's default vLLM mapping through
its core metrics extractor, then prints the endpoint's metrics as the picker's scorers would see them.

The engine serves one LoRA adapter (made by PEFT on the bundled model). Checked: the queue, running and
KV-usage gauges, the cache_config_info labels and vllm:lora_requests_info come through with the engine's
own values and without an extractor error, idle and under load (a request under the adapter running,
one for the base model waiting).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from cluster import REPO, free_port
from engines import Process
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def metrics_check() -> Path:
    proc = subprocess.run(["bash", str(HERE / "build_epp_metrics_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The bundled model with one adapter, `sql`, and room for one sequence at a time."""
    from tokenmill.engine.model.bundled import bundled_gguf_path
    from tokenmill.engine.model.gguf_cache import dequantized_copy_cached

    from tests.lora_adapters import make_peft_adapter

    # PEFT builds the adapter on a transformers model: the GGUF's weights dequantized to safetensors (the
    # engine's own cache folder holds only a link to the GGUF, which transformers cannot load).
    base = dequantized_copy_cached(bundled_gguf_path())
    adapter = make_peft_adapter(base, tmp_path_factory.mktemp("lora") / "sql", r=8)
    port, work = free_port(), tmp_path_factory.mktemp("engine")
    argv = [str(REPO / ".venv" / "bin" / "tokenmill"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL, "--max-num-seqs", "1", "--max-model-len", "512", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}", "--disable-access-log"]
    proc = Process(argv, work / "engine.log", env={"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(f"{url}/health", f"tokenmill serve on port {port}", 300)
    try:
        complete(url, MODEL, 1)  # one step: every gauge has been set once
        yield url
    finally:
        proc.stop()


def complete(url: str, model: str, max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def epp_view(metrics_check: Path, url: str) -> dict:
    out = subprocess.run([str(metrics_check), url.removeprefix("http://")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def engine_gauges(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(("vllm:num_requests", "vllm:kv_cache_usage"))}


def cache_config(url: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    [info] = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:cache_config_info"]
    return info.labels


def test_the_epp_reads_queue_running_kv_cache_config_and_lora(metrics_check, engine) -> None:
    view = epp_view(metrics_check, engine)
    m = view["metrics"]
    assert view["extractError"] == ""
    assert (m["WaitingQueueSize"], m["RunningRequestsSize"], m["KVCacheUsagePercent"]) == (0, 0, 0.0)
    labels = cache_config(engine)
    assert (m["CacheBlockSize"], m["CacheNumBlocks"]) == (int(labels["block_size"]), int(labels["num_gpu_blocks"]))
    assert m["CacheBlockSize"] == 16 and m["CacheNumBlocks"] > 0
    assert (m["MaxActiveModels"], m["ActiveModels"], m["WaitingModels"]) == (2, {}, {})

    # Under load: max_num_seqs is 1, so of two long requests the first (under `sql`) runs, the other waits.
    threads = [threading.Thread(target=complete, args=(engine, model, 200)) for model in ("sql", MODEL)]
    for t in threads:
        t.start()
        time.sleep(0.5)
    try:
        deadline = time.monotonic() + 120
        while engine_gauges(engine).get("vllm:num_requests_waiting") != 1.0:
            assert time.monotonic() < deadline, engine_gauges(engine)
            time.sleep(0.2)
        before = engine_gauges(engine)
        view = epp_view(metrics_check, engine)
        after = engine_gauges(engine)
        m = view["metrics"]
        assert view["extractError"] == ""
        assert (m["WaitingQueueSize"], m["RunningRequestsSize"]) == (1, 1), (before, m, after)
        lo, hi = sorted((before["vllm:kv_cache_usage_perc"], after["vllm:kv_cache_usage_perc"]))
        assert 0 < lo <= m["KVCacheUsagePercent"] <= hi <= 1
        # The picker's LoRA affinity sees the adapter running (the waiting request is the base model's).
        assert (m["ActiveModels"], m["WaitingModels"], m["MaxActiveModels"]) == ({"sql": 0}, {}, 2)
    finally:
        for t in threads:
            t.join()
