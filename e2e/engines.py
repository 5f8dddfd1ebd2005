"""Real processes behind the fake pods: `tokenmill serve` engines and Debian's Prometheus, on loopback.

kwok's pods run nothing, so the autoscaling test starts real engines itself and has Prometheus scrape
them under the labels of the fake pods (`namespace`, `pod`), which is what the operator queries. A
`PodTargets` thread keeps Prometheus' file-based service discovery in step with the pods that exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from cluster import REPO, Cluster, free_port


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Process:
    """A child process with its output in a log file, stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.argv, self.log = argv, log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, url: str, what: str, timeout: float) -> None:
        """Wait for `url` to answer 200; on failure stop the process (nobody else holds it yet) and raise."""
        deadline = time.monotonic() + timeout
        while not _get_ok(url):
            if self.proc.poll() is not None:
                self.stop()  # its children (the engine core) may still run in its session
                raise AssertionError(f"{what} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{what} not ready at {url} after {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 20) -> None:
        """SIGTERM to the process group it leads (the engine core child goes too), SIGKILL after `grace`."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        self.proc.wait(timeout=10)


def start_engine(workdir: Path, served_model_name: str, max_num_seqs: int, timeout: float = 300) -> tuple[Process, str]:
    """`tokenmill serve` with the bundled model on a free loopback port; returns (process, base URL)."""
    port = free_port()
    argv = [str(REPO / ".venv" / "bin" / "tokenmill"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_model_name, "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", "512", "--max-waiting-requests", "256", "--disable-access-log"]
    proc = Process(argv, workdir / f"engine-{port}.log", env={"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(f"{url}/health", f"tokenmill serve on port {port}", timeout)
    return proc, url


def queue_depth(base_url: str) -> float:
    """vllm:num_requests_waiting + vllm:num_requests_running, read straight from an engine's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as rsp:
        text = rsp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name in ("vllm:num_requests_waiting", "vllm:num_requests_running"))


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    assert found, "Debian's prometheus is not installed: run `make prometheus` (make test does it)"
    return found


def start_prometheus(workdir: Path, targets_file: Path, scrape_interval: str = "2s") -> tuple[Process, str]:
    """Prometheus scraping the targets in `targets_file`. The scrape timeout is the whole interval: a busy
    engine on a busy 2-core machine can take over a second to answer /metrics, and a failed scrape reads
    as a missing pod to the operator."""
    port = free_port()
    config = workdir / "prometheus.yml"
    targets_file.write_text("[]")
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval},
        "scrape_configs": [{"job_name": "tokenmill-engines", "metrics_path": "/metrics",
                            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}]}],
    }))
    argv = [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"]
    proc = Process(argv, workdir / "prometheus.log")
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(f"{url}/-/ready", "prometheus", 60)
    return proc, url


class PodTargets(threading.Thread):
    """Maps each running pod of an InferenceService to one real engine, first come first served, and
    writes Prometheus file_sd targets labelled with the pod's namespace and name."""

    def __init__(self, cluster: Cluster, namespace: str, selector: str, engines: list[str], targets_file: Path):
        super().__init__(daemon=True)
        self.cluster, self.namespace, self.selector = cluster, namespace, selector
        self.engines, self.targets_file = engines, targets_file
        self.assigned: dict[str, str] = {}  # pod name -> engine base URL
        self.unmapped: set[str] = set()  # pods that found no free engine (would mean too many replicas)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            proc = self.cluster.kubectl("get", "pods", "-n", self.namespace, "-l", self.selector, "-o", "json",
                                        check=False)
            if proc.returncode != 0:
                continue
            pods = [p for p in json.loads(proc.stdout)["items"]
                    if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
            names = {p["metadata"]["name"] for p in pods}
            self.assigned = {n: u for n, u in self.assigned.items() if n in names}
            for name in sorted(names - set(self.assigned)):
                free = [u for u in self.engines if u not in self.assigned.values()]
                if free:
                    self.assigned[name] = free[0]
                else:
                    self.unmapped.add(name)
            self._write()

    def _write(self) -> None:
        groups = [{"targets": [url.removeprefix("http://")], "labels": {"namespace": self.namespace, "pod": pod}}
                  for pod, url in sorted(self.assigned.items())]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)  # atomic: Prometheus never reads half a file

    def engine_of_first_pod(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while not self.assigned:
            assert time.monotonic() < deadline, "no running pod was mapped to an engine"
            time.sleep(0.2)
        return next(iter(self.assigned.values()))

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


class Load:
    """Keeps `concurrency` completions in flight against one engine until stopped (bounded by `limit_s`)."""

    def __init__(self, base_url: str, model: str, concurrency: int, max_tokens: int, limit_s: float = 180):
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.stop_event = threading.Event()
        self.deadline = time.monotonic() + limit_s
        self.completed = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(concurrency)]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def _worker(self) -> None:
        import httpx

        body = {"model": self.model, "prompt": "Write a long story about a lighthouse keeper.",
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=self.base_url, timeout=120) as client:
            while not self.stop_event.is_set() and time.monotonic() < self.deadline:
                try:
                    rsp = client.post("/v1/completions", json=body)
                    with self.lock:
                        if rsp.status_code == 200:
                            self.completed += 1
                        else:
                            self.errors.append(f"{rsp.status_code}: {rsp.text[:200]}")
                except httpx.HTTPError as e:
                    with self.lock:
                        self.errors.append(repr(e))

    def stop_sending(self) -> None:
        self.stop_event.set()

    def stop(self) -> None:
        """Stop sending; return when every in-flight request has finished."""
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=150)
