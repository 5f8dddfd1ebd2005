"""The endpoint picker's own code reads a real engine's /metrics: e2e/epp_metrics_check (built inside the
EPP v1.5.0 module by e2e/build_epp_metrics_check.sh) scrapes `tokenmill serve` with the EPP's HTTP
data source, parses it with the EPP's Prometheus parser and runs the EPP's default vLLM mapping through
its core metrics extractor, then prints the endpoint's metrics as the picker's scorers would see them.

Checked: the queue, running and KV-usage gauges and the cache_config_info labels come through with the
engine's own values, idle and under load (one sequence running, one waiting), and the extractor's only
complaint is the LoRA info gauge, which vLLM too publishes only with adapters enabled.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from engines import start_engine
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def metrics_check() -> Path:
    proc = subprocess.run(["bash", str(HERE / "build_epp_metrics_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    proc, url = start_engine(tmp_path_factory.mktemp("engine"), "smollm2-135m-instruct", max_num_seqs=1)
    try:
        yield url
    finally:
        proc.stop()


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


def lora_info(url: str) -> dict[str, str] | None:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = [s.labels for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "vllm:lora_requests_info"]
    return found[-1] if found else None


def test_the_epp_reads_queue_running_kv_and_cache_config(metrics_check, engine) -> None:
    view = epp_view(metrics_check, engine)
    m = view["metrics"]
    assert (m["WaitingQueueSize"], m["RunningRequestsSize"], m["KVCacheUsagePercent"]) == (0, 0, 0.0)
    labels = cache_config(engine)
    assert (m["CacheBlockSize"], m["CacheNumBlocks"]) == (int(labels["block_size"]), int(labels["num_gpu_blocks"]))
    assert m["CacheBlockSize"] == 16 and m["CacheNumBlocks"] > 0
    lora = lora_info(engine)
    if lora is None:  # only the LoRA gauge is missing (no adapters enabled), as with vLLM without --enable-lora
        assert view["extractError"] == 'metric family "vllm:lora_requests_info" not found'
    else:
        assert view["extractError"] == "" and m["MaxActiveModels"] == int(lora["max_lora"])

    # Under load: max_num_seqs is 1, so of two long requests one runs and one waits.
    def generate() -> None:
        body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 200,
                           "ignore_eos": True, "temperature": 0}).encode()
        req = urllib.request.Request(f"{engine}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    threads = [threading.Thread(target=generate) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.5)
    try:
        deadline = time.monotonic() + 120
        while engine_gauges(engine).get("vllm:num_requests_waiting") != 1.0:
            assert time.monotonic() < deadline, engine_gauges(engine)
            time.sleep(0.2)
        before = engine_gauges(engine)
        m = epp_view(metrics_check, engine)["metrics"]
        after = engine_gauges(engine)
        assert (m["WaitingQueueSize"], m["RunningRequestsSize"]) == (1, 1), (before, m, after)
        lo, hi = sorted((before["vllm:kv_cache_usage_perc"], after["vllm:kv_cache_usage_perc"]))
        assert 0 < lo <= m["KVCacheUsagePercent"] <= hi <= 1
    finally:
        for t in threads:
            t.join()
