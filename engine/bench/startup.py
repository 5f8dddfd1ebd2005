"""`tokenmill bench startup`: time to ready of a real `tokenmill serve`, several starts, with the breakdown.

Each run starts `tokenmill serve` as a child (the same interpreter), polls /health every 20 ms and
records: the first HTTP answer (the API process is up, /health says 503), /health 200 (the engine can
serve), and the `ready` log line with the engine core's start-up phases it reports (imports, config,
kernels, weights, runner: packing the weights and the KV pool). Then it sends SIGTERM and waits for
exit 0. Warm figures need the caches built first (the converted GGUF, the C++ kernels): the first run
of a fresh checkout is cold, so `--discard-first` drops it.
"""

import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

POLL_S = 0.02
_PHASE = re.compile(r"(.+) ([0-9.]+)s")
_STARTUP = re.compile(r"engine core start-up: (.*)\)\s*$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> int | None:
    """The status /health answers, or None while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def parse_phases(ready_line: str) -> dict[str, float]:
    """{'imports': 3.1, ...} from the ready line's "engine core start-up: imports 3.1s, ..." part."""
    m = _STARTUP.search(ready_line)
    if m is None:
        return {}
    return {name: float(sec) for name, sec in (_PHASE.fullmatch(part).groups() for part in m.group(1).split(", "))}


def one_start(serve_args: list[str], timeout_s: float) -> dict[str, Any]:
    """Start `tokenmill serve`, wait for /health 200, stop it; the timings of this one start."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/health"
    cmd = [sys.executable, "-m", "tokenmill.engine.cli.main", "serve", "--port", str(port), "--disable-access-log",
           *serve_args]  # fmt: skip
    lines: list[tuple[float, str]] = []
    # cwd: not the repository root, whose operator/ package would shadow the standard library's.
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-startup-") as cwd:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def read() -> None:
            for line in proc.stdout:
                lines.append((time.monotonic() - t0, line.rstrip()))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        first_answer = healthy = None
        try:
            while healthy is None:
                elapsed = time.monotonic() - t0
                if proc.poll() is not None:
                    raise RuntimeError(f"tokenmill serve exited with {proc.returncode} before /health said 200:\n"
                                       + "\n".join(text for _, text in lines[-20:]))
                if elapsed > timeout_s:
                    raise RuntimeError(f"/health did not say 200 within {timeout_s:.0f}s")
                status = _health(url)
                if status is not None and first_answer is None:
                    first_answer = elapsed
                if status == 200:
                    healthy = time.monotonic() - t0
                    break
                time.sleep(POLL_S)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            reader.join(5)
    ready = next(((t, text) for t, text in lines if "ready: serving" in text), None)
    launched = next((t for t, text in lines if "engine core process started" in text), None)
    listening = next((t for t, text in lines if "Uvicorn running on" in text), None)
    return {
        "first_http_answer_s": first_answer,
        "health_200_s": healthy,
        "ready_line_s": None if ready is None else ready[0],
        "engine_core_launched_s": launched,
        "api_listening_s": listening,
        "engine_core_phases_s": {} if ready is None else parse_phases(ready[1]),
        "exit_code": code,
    }


def run_startup_bench(serve_args: list[str], runs: int, discard_first: bool, timeout_s: float) -> dict[str, Any]:
    load_before = os.getloadavg()
    results = []
    for i in range(runs + int(discard_first)):
        r = one_start(serve_args, timeout_s)
        r["discarded"] = discard_first and i == 0
        results.append(r)
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r["engine_core_phases_s"].items())
        print(f"run {i}{' (discarded)' if r['discarded'] else ''}: first answer {r['first_http_answer_s']:.2f}s, "
              f"/health 200 {r['health_200_s']:.2f}s, core launched {r['engine_core_launched_s'] or 0:.2f}s; "
              f"core phases: {phases}; load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    kept = [r["health_200_s"] for r in results if not r["discarded"]]
    return {
        "serve_args": serve_args,
        "runs": results,
        "health_200_s": {"median": statistics.median(kept), "min": min(kept), "max": max(kept)},
        "loadavg_before_1_5_15m": [round(x, 2) for x in load_before],
    }
