"""The router's flow-control queue: how many requests a routed service's endpoint picker holds because no
engine pod can take them (none ready: a service at zero replicas; or all saturated). Read from the picker's
own /metrics, as the engines' are read (observe/engine_metrics.py)."""

from tokenmill.operator.children.router import EPP_METRICS_PORT
from tokenmill.operator.observe.engine_metrics import HttpGet, _default_get, is_ready

QUEUE_METRIC = "inference_extension_flow_control_queue_size"


def parse_router_queue(text: str, pool: str) -> float:
    """The requests held for `pool` (summed over priorities and flows). A picker that never queued has no
    series yet: 0."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == QUEUE_METRIC and s.labels.get("inference_pool") == pool)


def read_router_queue(pool: str, pods: list[dict], timeout: float = 2.0,
                      http_get: HttpGet = _default_get) -> tuple[float | None, str | None]:
    """(held requests, None), or (None, why not) when no ready router pod answered."""
    ready = [p for p in pods if is_ready(p) and (p.get("status") or {}).get("podIP")]
    if not ready:
        return None, "no ready router pod to read the flow-control queue from"
    errors = []
    total = 0.0
    for pod in ready:  # one picker normally; during a Recreate rollout never two at once
        ip = pod["status"]["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        try:
            rsp = http_get(f"http://{host}:{EPP_METRICS_PORT}/metrics", timeout=timeout)
            if rsp.status_code != 200:
                errors.append(f"{pod['metadata']['name']}: HTTP {rsp.status_code}")
                continue
            total += parse_router_queue(rsp.text, pool)
        except Exception as e:  # unreachable, timed out, garbage
            errors.append(f"{pod['metadata']['name']}: {e}")
    if errors and len(errors) == len(ready):
        return None, f"cannot read the router's /metrics ({'; '.join(errors)})"
    return total, None
