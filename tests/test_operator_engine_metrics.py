import json

import pytest
from tokenmill.operator.observe.engine_metrics import (
    TOTAL,
    default_queries,
    measured_capacity,
    parse_engine_metrics,
    query_prometheus,
    scrape_pods,
)

# What an engine's /metrics looks like (prometheus_client's text format, vLLM's names).
ENGINE_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="chat"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="chat"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="chat"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",model_name="chat",num_gpu_blocks="51467"} 1.0
# HELP tokenmill:kv_cache_capacity_tokens KV tokens the pool holds.
# TYPE tokenmill:kv_cache_capacity_tokens gauge
tokenmill:kv_cache_capacity_tokens{model_name="chat"} 823472.0
# HELP tokenmill:max_concurrency_at_max_model_len Sequences of max_model_len that fit.
# TYPE tokenmill:max_concurrency_at_max_model_len gauge
tokenmill:max_concurrency_at_max_model_len{model_name="chat"} 100.52
# HELP tokenmill:max_model_len Longest sequence.
# TYPE tokenmill:max_model_len gauge
tokenmill:max_model_len{model_name="chat"} 8192.0
# HELP tokenmill:model_load_seconds Seconds to load the model.
# TYPE tokenmill:model_load_seconds gauge
tokenmill:model_load_seconds{model_name="chat"} 12.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="chat"} 1234.0
"""


class Rsp:
    def __init__(self, status_code=200, text="", body=None):
        self.status_code, self.text, self._body = status_code, text, body

    def json(self):
        return self._body


def pod(name, ip):
    return {"metadata": {"name": name}, "status": {"podIP": ip}}


def test_parse_engine_metrics():
    r = parse_engine_metrics(ENGINE_TEXT)
    assert (r.waiting, r.running, r.queue_depth) == (3.0, 7.0, 10.0)
    assert r.capacity == {"kvTokens": 823472.0, "maxConcurrency": 100.52, "maxModelLen": 8192.0,
                          "modelLoadSeconds": 12.5, "kvBlocks": 51467.0, "blockSize": 16.0}


def test_missing_queue_gauges_are_no_reading():
    assert parse_engine_metrics("# TYPE x gauge\nx 1\n") is None


def test_scrape_pods_in_parallel_and_skip_failures():
    calls = []

    def get(url, timeout):
        calls.append(url)
        if "10.0.0.2" in url:
            raise OSError("connection refused")
        if "10.0.0.3" in url:
            return Rsp(503, "loading")
        return Rsp(200, ENGINE_TEXT)

    got = scrape_pods([pod("a", "10.0.0.1"), pod("b", "10.0.0.2"), pod("c", "10.0.0.3"), pod("d", None)], http_get=get)
    assert set(got) == {"a"} and got["a"].queue_depth == 10.0
    assert sorted(calls) == ["http://10.0.0.1:8000/metrics", "http://10.0.0.2:8000/metrics", "http://10.0.0.3:8000/metrics"]


def test_ipv6_pod_address():
    seen = []
    scrape_pods([pod("a", "fd00::5")], http_get=lambda url, timeout: seen.append(url) or Rsp(200, ENGINE_TEXT))
    assert seen == ["http://[fd00::5]:8000/metrics"]


def prom_server(results: dict):
    """A fake Prometheus query API: maps a query to its result vector."""
    asked = []

    def get(url, params, timeout):
        asked.append((url, params["query"]))
        result = results.get(params["query"])
        if result is None:
            return Rsp(400, body={"status": "error", "error": "bad query"})
        return Rsp(200, body={"status": "success", "data": {"resultType": "vector", "result": result}})

    return get, asked


def test_default_queries_select_namespace_and_ready_pods():
    q = default_queries("team-a", ["chat-1.x", "chat-2"])
    # PromQL strings use Go escapes: the regex escape of "." is written \\\\. inside the string
    assert 'namespace="team-a",pod=~"chat-1\\\\.x|chat-2"' in q["queue"]
    assert q["queue"].startswith("sum by (pod) (") and "vllm:num_requests_waiting|vllm:num_requests_running" in q["queue"]
    assert "timestamp(vllm:num_requests_running" in q["freshness"]


def test_query_prometheus_per_pod():
    q = default_queries("ns", ["a", "b"])
    get, asked = prom_server({
        q["queue"]: [{"metric": {"pod": "a"}, "value": [1000, "12"]}, {"metric": {"pod": "b"}, "value": [1000, "3"]}],
        q["freshness"]: [{"metric": {"pod": "a"}, "value": [1000, "995.5"]}],
        q["capacity"]: [{"metric": {"__name__": "tokenmill:kv_cache_capacity_tokens", "pod": "a"}, "value": [1000, "4096"]}],
    })
    got = query_prometheus("http://prom:9090/", "ns", "chat", ["a", "b"], http_get=get)
    assert got["a"].queue_depth == 12 and got["a"].timestamp == 995.5 and got["a"].capacity == {"kvTokens": 4096.0}
    assert got["b"].queue_depth == 3 and got["b"].timestamp is None
    assert all(url == "http://prom:9090/api/v1/query" for url, _ in asked)


def test_query_prometheus_custom_total():
    q = default_queries("ns", ["a"])
    custom = 'sum(my_queue{namespace="$namespace",svc="$name",pod=~"$pods"})'
    get, _asked = prom_server({'sum(my_queue{namespace="ns",svc="chat",pod=~"a"})': [{"metric": {}, "value": [0, "42"]}],
                              q["capacity"]: []})
    got = query_prometheus("http://p", "ns", "chat", ["a"], custom_query=custom, http_get=get)
    assert got[TOTAL].queue_depth == 42


def test_prometheus_errors_raise():
    get, _ = prom_server({})
    with pytest.raises(RuntimeError, match="Prometheus answered 400"):
        query_prometheus("http://p", "ns", "chat", ["a"], http_get=get)


def test_measured_capacity_is_the_smallest_replica():
    a = parse_engine_metrics(ENGINE_TEXT)
    b = parse_engine_metrics(ENGINE_TEXT.replace("823472.0", "800000.0").replace("12.5", "30.25"))
    m = measured_capacity({"a": a, "b": b})
    assert m["pods"] == 2 and m["kvTokens"] == 800000 and m["modelLoadSeconds"] == 30.25
    assert m["kvBlocks"] == 51467 and m["blockSize"] == 16 and m["maxModelLen"] == 8192
    assert json.dumps(m)  # plain JSON for the status
    assert measured_capacity({}) == {}
