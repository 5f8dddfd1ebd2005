"""The operator's own Prometheus metrics (scraped through the chart's metrics Service)."""

from prometheus_client import Counter, Histogram, start_http_server

RECONCILES = Counter(
    "tokenmill_operator_reconciles", "InferenceService reconciles by result", ["result"]
)
RECONCILE_SECONDS = Histogram(
    "tokenmill_operator_reconcile_seconds", "Time spent in one reconcile of an InferenceService"
)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose /metrics (plus the process and Python collectors) on addr:port in a daemon thread."""
    start_http_server(port, addr=addr)
