"""Helpers for the server tests: start a real `tokenmill serve` process on a free loopback port, wait
for /health, read /metrics, find the engine-core child process. Imported by tests/test_server_*.py."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = pathlib.Path(__file__).resolve().parents[1]
# Several engineers share two cores: startup (imports, model load) can take a minute under load.
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `tokenmill serve` child; its log goes to a file (a pipe could fill up and stall it)."""

    def __init__(self, *args: str, log_dir: pathlib.Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = pathlib.Path(tempfile.mkstemp(prefix="serve-", suffix=".log", dir=log_dir)[1])
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        cmd = [sys.executable, "-m", "tokenmill.engine.cli.main", "serve", "--port", str(self.port), *args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def first_health(self, timeout_s: float = STARTUP_TIMEOUT_S) -> httpx.Response:
        """The first answer /health gives once the port is open."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                return httpx.get(f"{self.url}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"/health never answered (exit code {self.proc.returncode}):\n{self.log()}")

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout_s}s:\n{self.log()}")

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Every sample as 'name{label=value,...}' (labels sorted, model_name dropped) -> value."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def metric_families(self, headers: dict[str, str] | None = None) -> set[str]:
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        return {f.name for f in text_string_to_metric_families(text)}

    def wait_metric(
        self, name: str, predicate, timeout_s: float = 30.0, headers: dict | None = None
    ) -> float:
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.metrics(headers).get(name)
            if value is not None and predicate(value):
                return value
            time.sleep(0.1)
        raise AssertionError(f"{name} = {value} did not satisfy the condition within {timeout_s}s")

    def core_pid(self) -> int:
        """The engine-core child (started with `-m tokenmill.engine.core.proc`)."""
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"tokenmill.engine.core.proc" in cmdline:
                return int(entry.name)
        raise AssertionError("no engine-core child process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def running_and_kv(server: ServerProcess, headers: dict | None = None) -> tuple[float, float]:
    m = server.metrics(headers)
    return m["vllm:num_requests_running"], m["vllm:kv_cache_usage_perc"]


def wait_idle(server: ServerProcess, timeout_s: float = 30.0, headers: dict | None = None) -> None:
    """Running requests and KV usage back to zero (what a leak or a missed abort would break)."""
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        state = running_and_kv(server, headers)
        if state == (0.0, 0.0):
            return
        time.sleep(0.1)
    raise AssertionError(f"(running, kv usage) = {state}, not (0, 0), after {timeout_s}s")


def serving(*args: str, log_dir: pathlib.Path) -> Iterator[ServerProcess]:
    """A module fixture's body: start, wait for /health, yield, stop; a clean shutdown must exit 0."""
    s = ServerProcess(*args, log_dir=log_dir)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.log()
