"""Reading the engines' metrics: queue depth for the autoscaler, capacity for status.sizing.measured.

Two sources: each ready pod's /metrics (Prometheus text, parsed with prometheus_client's parser), or a
Prometheus server's query API. Both return the same PodReading per pod; a pod that did not answer or
has no series is simply absent, and the autoscaler decides what absence means.
"""

import math
import string
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tokenmill.engine import metric_names as mn
from tokenmill.operator.children.leaderworkerset import serving_pods
from tokenmill.operator.children.meta import PORT
from tokenmill.operator.plan.observations import TOTAL, EngineReadings, PodReading
from tokenmill.operator.plan.spec import ServiceSpec

# capacity gauge -> status.sizing.measured key
CAPACITY_GAUGES = {
    mn.KV_CAPACITY_TOKENS: "kvTokens",
    mn.MAX_CONCURRENCY: "maxConcurrency",
    mn.MAX_MODEL_LEN: "maxModelLen",
    mn.MODEL_LOAD_SECONDS: "modelLoadSeconds",
}


def _add_sample(reading: PodReading, name: str, labels: dict, value: float) -> None:
    if math.isnan(value):
        return
    if name == mn.NUM_REQUESTS_WAITING:
        reading.waiting += value
    elif name == mn.NUM_REQUESTS_RUNNING:
        reading.running += value
    elif name == f"{mn.PROMPT_TOKENS}_total":
        reading.prompt_tokens = (reading.prompt_tokens or 0.0) + value
    elif name in CAPACITY_GAUGES:
        reading.capacity[CAPACITY_GAUGES[name]] = value
    elif name == mn.LORA_ADAPTER_INFO and labels.get("lora_name"):
        reading.lora[labels["lora_name"]] = (labels.get("status", ""), labels.get("reason", ""))
    elif name == mn.CACHE_CONFIG_INFO:
        for label, key in (("num_gpu_blocks", "kvBlocks"), ("block_size", "blockSize")):
            if labels.get(label) not in (None, "", "None"):
                reading.capacity[key] = float(labels[label])


def parse_engine_metrics(text: str) -> PodReading | None:
    """Queue depth and capacity from an engine's /metrics; None when the queue gauges are absent."""
    from prometheus_client.parser import text_string_to_metric_families

    reading = PodReading()
    seen = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            seen.add(sample.name)
            _add_sample(reading, sample.name, sample.labels, sample.value)
    if mn.NUM_REQUESTS_WAITING not in seen or mn.NUM_REQUESTS_RUNNING not in seen:
        return None
    return reading


HttpGet = Callable[..., object]  # httpx.get-like: (url, params=..., timeout=...) -> response


def _default_get(url: str, params: dict | None = None, timeout: float = 2.0):
    import httpx

    return httpx.get(url, params=params, timeout=timeout)


def scrape_pods(pods: list[dict], timeout: float = 2.0, http_get: HttpGet = _default_get) -> dict[str, PodReading]:
    """GET http://POD_IP:8000/metrics on every pod in parallel; pods that fail are left out."""

    def one(pod: dict) -> tuple[str, PodReading | None]:
        name = pod["metadata"]["name"]
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return name, None
        host = f"[{ip}]" if ":" in ip else ip
        try:
            rsp = http_get(f"http://{host}:{PORT}/metrics", timeout=timeout)
            if rsp.status_code != 200:
                return name, None
            return name, parse_engine_metrics(rsp.text)
        except Exception:  # unreachable, timed out, garbage: the pod has no reading this round
            return name, None

    if not pods:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(pods))) as pool:
        results = list(pool.map(one, pods))
    return {name: r for name, r in results if r is not None}


def pods_regex(pod_names: list[str]) -> str:
    """Pod names (DNS subdomains: a-z, 0-9, '-', '.') as an RE2 alternation inside a PromQL string,
    where the regex escape of '.' must itself be escaped."""
    return "|".join(n.replace(".", "\\\\.") for n in sorted(pod_names))


def default_queries(namespace: str, pod_names: list[str]) -> dict[str, str]:
    sel = f'namespace="{namespace}",pod=~"{pods_regex(pod_names)}"'
    queue = f"{mn.NUM_REQUESTS_WAITING}|{mn.NUM_REQUESTS_RUNNING}"
    capacity = "|".join([*CAPACITY_GAUGES, mn.CACHE_CONFIG_INFO])
    return {
        "queue": f'sum by (pod) ({{__name__=~"{queue}",{sel}}})',
        # timestamp() of one gauge per pod: how old the newest sample is (staleness).
        "freshness": f"max by (pod) (timestamp({mn.NUM_REQUESTS_RUNNING}{{{sel}}}))",
        "capacity": f'{{__name__=~"{capacity}",{sel}}}',
    }


def _prom_query(url: str, query: str, timeout: float, http_get: HttpGet) -> list[dict]:
    rsp = http_get(url.rstrip("/") + "/api/v1/query", params={"query": query}, timeout=timeout)
    if rsp.status_code != 200:
        raise RuntimeError(f"Prometheus answered {rsp.status_code} to {query!r}")
    body = rsp.json()
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus query {query!r} failed: {body.get('error')}")
    data = body["data"]
    if data.get("resultType") == "scalar":
        return [{"metric": {}, "value": data["result"]}]
    return data.get("result") or []


def query_prometheus(
    url: str,
    namespace: str,
    name: str,
    pod_names: list[str],
    custom_query: str | None = None,
    timeout: float = 3.0,
    http_get: HttpGet = _default_get,
) -> dict[str, PodReading]:
    """Readings per pod from Prometheus; raises RuntimeError when Prometheus cannot be queried."""
    if not pod_names:
        return {}
    queries = default_queries(namespace, pod_names)
    readings: dict[str, PodReading] = {}
    if custom_query:
        q = string.Template(custom_query).safe_substitute(namespace=namespace, name=name, pods=pods_regex(pod_names))
        for series in _prom_query(url, q, timeout, http_get):
            pod = series.get("metric", {}).get("pod", TOTAL)
            readings.setdefault(pod, PodReading()).running += float(series["value"][1])
    else:
        for series in _prom_query(url, queries["queue"], timeout, http_get):
            pod = series.get("metric", {}).get("pod")
            if pod:
                readings.setdefault(pod, PodReading()).running = float(series["value"][1])
        for series in _prom_query(url, queries["freshness"], timeout, http_get):
            pod = series.get("metric", {}).get("pod")
            if pod in readings:
                readings[pod].timestamp = float(series["value"][1])
    for series in _prom_query(url, queries["capacity"], timeout, http_get):
        labels = series.get("metric", {})
        pod = labels.get("pod")
        if pod in readings:
            _add_sample(readings[pod], labels.get("__name__", ""), labels, float(series["value"][1]))
    return readings


def measured_capacity(readings: dict[str, PodReading]) -> dict:
    """status.sizing.measured: the smallest capacity across pods (what every replica can hold), the
    longest load time."""
    caps = [r.capacity for r in readings.values() if r.capacity]
    if not caps:
        return {}
    out: dict = {"pods": len(caps)}
    for key in ("kvTokens", "kvBlocks", "blockSize", "maxModelLen", "maxConcurrency"):
        values = [c[key] for c in caps if key in c]
        if values:
            out[key] = min(values) if key == "maxConcurrency" else int(min(values))
    loads = [c["modelLoadSeconds"] for c in caps if "modelLoadSeconds" in c]
    if loads:
        out["modelLoadSeconds"] = round(max(loads), 3)
    return out


def is_ready(pod: dict) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


Readings = Callable[..., dict[str, PodReading]]  # scrape_pods or query_prometheus (tests pass stand-ins)


def read_engines(spec: ServiceSpec, pods: list[dict], autoscale: bool, timeout: float, scrape: Readings,
                 query: Readings) -> EngineReadings:
    """The ready serving pods, and (on autoscaling passes) what their engines report. A fixed-size service
    (spec.scaling None) is read from its pods too: the readings fill status.sizing.measured."""
    ready = [p for p in serving_pods(pods) if is_ready(p)]
    if not autoscale or not ready:
        return EngineReadings(ready)
    if spec.scaling is not None and spec.scaling.metrics_source == "prometheus":
        try:
            readings = query(
                spec.scaling.prometheus_url, spec.namespace, spec.name, [p["metadata"]["name"] for p in ready],
                spec.scaling.prometheus_query, timeout=max(timeout, 3.0),
            )
        except Exception as e:  # Prometheus down or answering garbage: hold, and say so
            return EngineReadings(ready, error=f"cannot query Prometheus at {spec.scaling.prometheus_url}: {e}")
    else:
        try:
            readings = scrape(ready, timeout=timeout)
        except Exception as e:
            return EngineReadings(ready, error=f"cannot read the pods' /metrics: {e}")
    return EngineReadings(ready, readings, measured=measured_capacity(readings))
