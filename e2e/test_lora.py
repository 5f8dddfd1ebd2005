"""LoRA adapters end to end: an InferenceService of the bundled model with two adapters published on the
Hub stand-in (tests/hub_standin.py, through the HF_ENDPOINT the operator writes). The pod runs the real
engine with the operator's argv; the engine downloads the adapters into the model cache, and the official
openai client gets each adapter's answer by `model`; the pod's /metrics has vllm:lora_requests_info as vLLM
exposes it; status.lora lists both adapters, loaded, from the engine's own tokenmill:lora_adapter_info. Then
one adapter is swapped for another in the spec: the running pod serves the new set without a restart."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from cluster import Cluster
from e2e_helpers import ISVC, apply, get, wait_for
from hub_standin import HubStandin
from pod_runner import PodRunner
from test_pod_runner import proc_argv, runner_pods, wait_ready_sampling_kstatus, with_runner
from test_pod_runner_hub import hub_operator  # noqa: F401 (the fixture: the operator with --hf-endpoint=hub.url)

REPOS = {"sql": "acme/smollm2-sql-lora", "chat": "acme/smollm2-chat-lora", "poem": "acme/smollm2-poem-lora"}
FIRST = ("sql", "chat")
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubStandin]:
    # Adapters in PEFT's files for the bundled model (tokenmill bench lora's writer: random A and B, every
    # q/k/v/o/gate/up/down target at rank 8), large enough to change the greedy answer.
    from tokenmill.engine.bench.lora import write_random_adapter
    from tokenmill.engine.model.resolve import resolve_model

    model = resolve_model(None)
    with HubStandin() as hub:
        for seed, (name, repo) in enumerate(REPOS.items()):
            folder = write_random_adapter(model, tmp_path_factory.mktemp(name), rank=8, seed=seed, std=0.05)
            hub.add_repo(repo, folder, tags=("v1",))
        yield hub


@pytest.mark.usefixtures("hub_operator")
def test_two_hub_adapters_answer_by_model_name_with_the_gauge_and_status(
        cluster: Cluster, pod_runner: PodRunner, hub: HubStandin,
        namespace: str) -> None:
    name = "lora"
    isvc = with_runner({
        "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": "bundled://smollm2-135m-instruct", "name": "smollm2",
                      "lora": {"adapters": [{"name": n, "uri": f"hf://{REPOS[n]}@v1"} for n in FIRST],
                               "maxRank": 8, "maxAdapters": 2}},
            "engine": {"maxModelLen": 2048},
            "resources": {"gpu": {"type": "nvidia-l4"}},
        },
    })
    try:
        apply(cluster, isvc)
        obj, _ = wait_ready_sampling_kstatus(cluster, namespace, name)
        assert obj["status"]["sizing"]["loraSlotBytes"] > 0, obj["status"]["sizing"]
        assert "LoRA slots (2 adapters of rank 8)" in obj["status"]["sizing"]["message"]
        cm = get(cluster, "configmap", f"{name}-lora-adapters", namespace)
        assert [a["name"] for a in json.loads(cm["data"]["adapters.json"])] == ["sql", "chat"]

        pods = runner_pods(cluster, namespace, name)
        assert len(pods) == 1
        pod = pods[0]
        # The engine runs the Deployment's argv; the runner's documented deviations (bind address, KV cap, a
        # mount path in args rewritten to the volume's folder: the ConfigMap's file) are the only differences.
        c = get(cluster, "deployment", name, namespace)["spec"]["template"]["spec"]["containers"][0]
        wanted = [*c["command"][1:], *c["args"]]
        got = proc_argv(pod_runner.worker(namespace, pod["metadata"]["name"]).containers[0].pid)[2:]
        diffs = {wanted[i - 1] for i, (a, b) in enumerate(zip(got, wanted, strict=True)) if a != b}
        assert diffs <= {"--host", "--kv-cache-memory", "--lora-modules-file"}, diffs
        lora_file = got[wanted.index("--lora-modules-file") + 1]
        assert lora_file.endswith("/volumes/lora-adapters/adapters.json"), lora_file
        client = openai.OpenAI(base_url=f"http://{pod['status']['podIP']}:8000/v1", api_key="unused",
                               max_retries=0, timeout=600)  # fmt: skip
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"smollm2", "sql", "chat"}
        assert cards["sql"].model_extra["parent"] == "smollm2" and cards["chat"].model_extra["parent"] == "smollm2"
        texts = {}
        for model in ("smollm2", "sql", "chat"):
            r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
            assert r.model == model and r.usage.completion_tokens == 8
            texts[model] = r.choices[0].text
        assert len(set(texts.values())) == 3, texts  # each adapter answers differently from the base model
        # The adapters' two files came from the stand-in, once each, into the pod's model cache.
        for repo in (REPOS[n] for n in FIRST):
            got = sorted(r.filename for r in hub.requests(repo, "GET") if r.filename and r.status in (200, 206))
            assert got == ["adapter_config.json", "adapter_model.safetensors"], got

        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=30).text
        info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:lora_requests_info"]
        # The latest series, and the latest naming an adapter when that is an older one (docs/serving.md).
        assert 1 <= len(info) <= 2 and all(s.labels["max_lora"] == "2" for s in info), info
        assert all(set(s.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} for s in info)
        named = max((s for s in info if s.labels["running_lora_adapters"]), key=lambda s: s.value)
        assert set(named.labels["running_lora_adapters"].split(",")) <= {"sql", "chat"}, named

        def both_loaded() -> dict | None:
            lora = ((get(cluster, ISVC, name, namespace) or {}).get("status") or {}).get("lora") or {}
            return lora if lora.get("loaded") == 2 else None

        lora = wait_for(both_loaded, "status.lora: both adapters loaded", timeout=180)
        assert [(a["name"], a["uri"], a["loaded"], a["pods"]) for a in lora["adapters"]] == [
            ("sql", f"hf://{REPOS['sql']}@v1", True, "1/1"), ("chat", f"hf://{REPOS['chat']}@v1", True, "1/1")]

        # chat out, poem in: the ConfigMap changes, the pod template does not; the running engine follows.
        dep_generation = get(cluster, "deployment", name, namespace)["metadata"]["generation"]
        isvc["spec"]["model"]["lora"]["adapters"] = [{"name": n, "uri": f"hf://{REPOS[n]}@v1"} for n in ("sql", "poem")]
        apply(cluster, isvc)

        def swapped() -> set | None:
            names = {m.id for m in client.models.list().data}
            return names if "poem" in names and "chat" not in names else None

        assert wait_for(swapped, "the engine serves poem, not chat", timeout=180) == {"smollm2", "sql", "poem"}
        r = client.completions.create(model="poem", prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.model == "poem" and r.choices[0].text not in (texts["smollm2"], texts["sql"])
        same = next(p for p in runner_pods(cluster, namespace, name) if p["metadata"]["uid"] == pod["metadata"]["uid"])
        assert same["status"]["containerStatuses"][0]["restartCount"] == 0
        assert get(cluster, "deployment", name, namespace)["metadata"]["generation"] == dep_generation  # no rollout

        def poem_loaded() -> list | None:
            lora = ((get(cluster, ISVC, name, namespace) or {}).get("status") or {}).get("lora") or {}
            adapters = lora.get("adapters") or []
            return adapters if [(a["name"], a["loaded"]) for a in adapters] == [("sql", True), ("poem", True)] else None

        wait_for(poem_loaded, "status.lora: sql and poem loaded", timeout=180)
        assert pod_runner.all_errors() == []
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s", check=False)
