"""The operator's own /metrics: reconcile outcomes are counted and served over HTTP."""

import socket
import types
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from tokenmill.operator import handlers, self_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(text: str, name: str, result: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels.get("result") == result:
                return s.value
    return 0.0


def test_failed_and_successful_reconciles_are_counted_on_the_metrics_port(monkeypatch) -> None:
    port = free_port()
    self_metrics.serve(port, addr="127.0.0.1")

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    name = "tokenmill_operator_reconciles_total"
    before_err, before_ok = sample(scrape(), name, "error"), sample(scrape(), name, "ok")
    memo = types.SimpleNamespace(api=None, config=types.SimpleNamespace(interval=1))
    body = {"metadata": {"namespace": "ns", "name": "x"}}

    def boom(*a, **k):
        raise RuntimeError("API down")

    monkeypatch.setattr(handlers.rec, "reconcile", boom)
    handlers._safe_reconcile(memo, body, autoscale=False)  # logs, never raises
    monkeypatch.setattr(handlers.rec, "reconcile", lambda *a, **k: None)
    handlers._safe_reconcile(memo, body, autoscale=False)
    text = scrape()
    assert sample(text, name, "error") == before_err + 1
    assert sample(text, name, "ok") == before_ok + 1
