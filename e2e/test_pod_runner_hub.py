"""hf:// InferenceServices whose pods run their real command: the engine in the pod downloads from the Hub
stand-in (tests/hub_standin.py, the one stand-in, through the HF_ENDPOINT the operator writes), becomes
ready, and answers at its pod IP; replicas and restarts on the shared cache volume do not download again.

The stand-in serves three repos:
- `HuggingFaceTB/SmolLM2-135M-Instruct`: the bundled GGUF's conversion to a Hugging Face folder (the same
  model the real repo holds, dequantized from Q4_1, stored in fp32), so examples/hub-model-cached.yaml
  runs as written;
- `standin/SmolLM2-135M-Instruct-bf16`: the same weights stored in bf16 as the real repo stores its own
  (tests/half_checkpoints.py: half the bytes, config.json's torch_dtype bfloat16), the format of nearly
  every Hub model; the hub example runs against both;
- `acme/smollm2-gated`: the GGUF conversion again, gated, granted to one token.
The session's operator is replaced for this module by one with --hf-endpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import Cluster
from e2e_helpers import (
    ISVC,
    OperatorProcess,
    apply,
    condition,
    get,
    prebound_volume,
    replaced_operator,
    wait_for,
)
from hub_standin import HubStandin, cast_checkpoint
from pod_runner import PodRunner
from test_examples import example
from test_pod_runner import (
    ENGINE_START_S,
    assert_runs_deployment_argv,
    completion,
    runner_pods,
    wait_ready_sampling_kstatus,
    with_runner,
)
from tokenmill.engine.hub_client import ENGINE_CLIENT, OPERATOR_CLIENT

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_BF16 = "standin/SmolLM2-135M-Instruct-bf16"
GATED = "acme/smollm2-gated"
TOKEN = "hf_e2e_granted"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubStandin]:
    # The engine (torch) is imported only when this module runs.
    from tokenmill.engine.model.bundled import bundled_gguf_path
    from tokenmill.engine.model.gguf_cache import dequantized_copy_cached

    folder = dequantized_copy_cached(bundled_gguf_path())
    bf16 = cast_checkpoint(folder, tmp_path_factory.mktemp("smollm2-bf16"), "bfloat16")
    with HubStandin() as hub:
        hub.smollm2_sha = hub.add_repo(SMOLLM2, folder)
        hub.shas = {SMOLLM2: hub.smollm2_sha, SMOLLM2_BF16: hub.add_repo(SMOLLM2_BF16, bf16)}
        hub.gated_sha = hub.add_repo(GATED, folder, tags=("v1",), gated=True, tokens=(TOKEN,))
        yield hub


@pytest.fixture(scope="module")
def hub_operator(cluster: Cluster, operator: OperatorProcess, chart_release: str, hub: HubStandin,
                 tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("op") / "operator.log"
    with replaced_operator(cluster, operator, chart_release, [f"--hf-endpoint={hub.url}"], log) as mine:
        yield mine


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def engine_pid(runner: PodRunner, pod: dict) -> int:
    worker = runner.worker(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert worker is not None, f"the runner runs nothing for {pod['metadata']['name']}"
    pid = worker.containers[0].pid
    assert pid is not None, worker.containers[0].state
    return pid


def file_gets(hub: HubStandin, repo: str, client: str = ENGINE_CLIENT) -> list[str]:
    """Every answered GET of a file's content (not HEADs, not API calls) by one client: the engines'
    ("tokenmill/...") or the operator's ("tokenmill-operator/...", its sizing lookups), told apart by the
    User-Agent each names itself in."""
    return [r.filename for r in hub.requests(repo, "GET")
            if r.filename and r.status in (200, 206) and r.user_agent.startswith(f"{client}/")]


def weights_bytes(hub: HubStandin, repo: str) -> int:
    """What the stand-in holds of the repo's safetensors at main (the files on disk)."""
    files = hub.repos[repo].commits[hub.repos[repo].refs["main"]].values()
    return sum(f.size for f in files if f.path.endswith(".safetensors"))


@pytest.mark.parametrize("repo", [SMOLLM2, SMOLLM2_BF16], ids=["gguf-fp32", "bf16"])
def test_hub_example_downloads_once_into_the_shared_cache_and_answers(
        cluster: Cluster, hub_operator: OperatorProcess, pod_runner: PodRunner, hub: HubStandin,
        namespace: str, repo: str) -> None:
    isvc = with_runner(next(d for d in example("hub-model-cached.yaml", namespace) if d["kind"] == "InferenceService"))
    assert isvc["spec"]["model"]["uri"] == f"hf://{SMOLLM2}@main"  # the example as written...
    isvc["spec"]["model"]["uri"] = f"hf://{repo}@main"  # ...or its bf16 twin
    name = isvc["metadata"]["name"]
    claim = f"{name}-model-cache"
    # No storage provisioner here: a volume pre-bound to the claim the operator will create. The runner
    # gives every claim one folder, which both pods then share.
    pv = prebound_volume(cluster, namespace, claim)
    try:
        hub.reset_log()
        apply(cluster, isvc)
        obj, seen = wait_ready_sampling_kstatus(cluster, namespace, name)
        assert obj["status"]["readyReplicas"] == 2, obj["status"]
        assert obj["status"]["sizing"]["hub"]["commit"] == hub.shas[repo], obj["status"]["sizing"]
        # Sized from the repo's own files: the bf16 one's weights are half the fp32 conversion's bytes.
        assert obj["status"]["sizing"]["hub"]["weightsBytes"] == weights_bytes(hub, repo), obj["status"]["sizing"]
        assert any(s == "InProgress" for _, _, s in seen) and seen[-1][2] == "Current", seen
        assert get(cluster, "pvc", claim, namespace)["status"]["phase"] == "Bound"

        pods = runner_pods(cluster, namespace, name)
        assert len(pods) == 2
        homes = set()
        for pod in pods:
            assert_runs_deployment_argv(cluster, pod_runner, namespace, name, pod)
            env = environ(engine_pid(pod_runner, pod))
            assert env["HF_ENDPOINT"] == hub.url  # what the operator wrote, unchanged
            homes.add(env["HF_HOME"])
            rsp = completion(pod)
            assert rsp.status_code == 200, rsp.text
            assert rsp.json()["choices"][0]["text"], rsp.json()
        assert len(homes) == 1, homes  # one cache folder: the claim's
        assert Path(homes.pop()).is_relative_to(pod_runner.root / "claims" / namespace / claim)
        # Two pods started together on one cache: the weights came over the wire once (the client's file
        # lock made the second wait for the first), and every file the engine loads at most once.
        gets = file_gets(hub, repo)
        assert gets.count(WEIGHTS) == 1, gets
        assert len(gets) == len(set(gets)), gets
        # The operator reads config.json only for a model its catalog lacks (the bf16 twin's stand-in name),
        # once; nothing else of the repo.
        assert file_gets(hub, repo, OPERATOR_CLIENT) == (["config.json"] if repo == SMOLLM2_BF16 else []), \
            hub.requests(repo)

        # A restart (pod deleted, the ReplicaSet makes a new one) reads the cache: no file fetched at all.
        hub.reset_log()
        old = pods[0]
        cluster.kubectl("delete", "pod", old["metadata"]["name"], "-n", namespace, "--wait=false")
        def replaced() -> dict | None:
            now = runner_pods(cluster, namespace, name)
            fresh = [p for p in now if p["metadata"]["uid"] not in {q["metadata"]["uid"] for q in pods}]
            ready = fresh and (condition(fresh[0], "Ready") or {}).get("status") == "True"
            return fresh[0] if ready and len(now) == 2 else None

        new = wait_for(replaced, "the replacement pod Ready", timeout=ENGINE_START_S)
        wait_for(lambda: (o := get(cluster, ISVC, name, namespace)) and o["status"].get("readyReplicas") == 2,
                 "readyReplicas 2 again", timeout=60)
        assert completion(new).status_code == 200
        assert file_gets(hub, repo) == file_gets(hub, repo, OPERATOR_CLIENT) == [], hub.requests(repo)
        assert pod_runner.all_errors() == []
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "pv", pv, "--ignore-not-found")


def test_gated_hub_model_downloads_with_the_token_secret_and_answers(
        cluster: Cluster, hub_operator: OperatorProcess, pod_runner: PodRunner, hub: HubStandin,
        namespace: str) -> None:
    """A gated repo the catalog lacks, with the chart's default RBAC (helm install, the operator on its
    ServiceAccount's token): `get` on Secrets named hf-token lets the operator read the token and size the
    model from its config.json; the engine downloads with the same token."""
    cluster.kubectl("create", "secret", "generic", "hf-token", f"--from-literal=HF_TOKEN={TOKEN}", "-n", namespace)
    hub.reset_log()
    apply(cluster, with_runner({
        "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "gated"},
        "spec": {"model": {"uri": f"hf://{GATED}@v1", "tokenSecretRef": {"name": "hf-token"}},
                 "resources": {"gpu": {"type": "nvidia-l4", "count": 1}}, "replicas": 1}}), namespace)
    obj, _ = wait_ready_sampling_kstatus(cluster, namespace, "gated")
    sizing = obj["status"]["sizing"]
    assert sizing["profileSource"] == "hub", sizing  # sized from the gated config.json, read with the token
    assert sizing["hub"]["commit"] == hub.gated_sha and sizing["hub"]["gated"] is True, sizing["hub"]
    assert (condition(obj, "Stalled") or {}).get("status") != "True", obj["status"]["conditions"]
    config_gets = [r for r in hub.requests(GATED, "GET") if r.filename == "config.json" and r.status == 200]
    assert config_gets and all(r.authorization for r in config_gets), hub.requests(GATED)
    [pod] = runner_pods(cluster, namespace, "gated")
    assert_runs_deployment_argv(cluster, pod_runner, namespace, "gated", pod)
    assert environ(engine_pid(pod_runner, pod))["HF_TOKEN"] == TOKEN  # from the Secret, as the kubelet does
    rsp = completion(pod)
    assert rsp.status_code == 200, rsp.text
    assert rsp.json()["usage"]["completion_tokens"] >= 1
    weights = [r for r in hub.requests(GATED, "GET") if r.filename == WEIGHTS and r.status == 200]
    assert len(weights) == 1 and weights[0].authorization, hub.requests(GATED)
    assert pod_runner.all_errors() == []


def test_gated_hub_model_with_a_secret_outside_the_chart_rbac_says_what_to_grant(
        cluster: Cluster, hub_operator: OperatorProcess, namespace: str) -> None:
    """The same repo with its token in a Secret the default RBAC does not name: the API server refuses the
    operator's read (a real 403), so it cannot fetch config.json and stalls with GatedModel naming the
    chart value, before any pod."""
    cluster.kubectl("create", "secret", "generic", "team-token", f"--from-literal=HF_TOKEN={TOKEN}", "-n", namespace)
    apply(cluster, {
        "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "gated"},
        "spec": {"model": {"uri": f"hf://{GATED}@v1", "tokenSecretRef": {"name": "team-token"}},
                 "resources": {"gpu": {"type": "nvidia-l4", "count": 1}}, "replicas": 1}}, namespace)
    obj = wait_for(lambda: (o := get(cluster, ISVC, "gated", namespace))
                   and (condition(o, "Stalled") or {}).get("status") == "True" and o, "Stalled", timeout=90)
    sized = condition(obj, "Sized")
    assert (sized["status"], sized["reason"]) == ("False", "GatedModel"), sized
    assert "may not read Secret team-token" in sized["message"], sized["message"]
    assert "add team-token to the chart value rbac.secretNames" in sized["message"], sized["message"]
    assert TOKEN not in json.dumps(obj)
    assert get(cluster, "deployment", "gated", namespace) is None
