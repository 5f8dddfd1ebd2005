"""Multi-node replicas: a model too big for one 8-GPU node runs as LeaderWorkerSet groups, created by the
real LWS controller (sigs.k8s.io/lws v0.6.2, built from the Go module proxy by e2e/build_lws.sh) and
scheduled by the real scheduler across the kwok H100 nodes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import Cluster
from e2e_helpers import (
    ISVC,
    OperatorProcess,
    apply,
    condition,
    get,
    items,
    ready_for_current_generation,
    wait_for,
)
from lws_controller import start as start_lws
from pod_runner import RUNNER_LABEL, PodRunner
from test_pod_runner import assert_runs_container_argv, openai_completion, wait_ready_sampling_kstatus

# Llama-3.1-405B in bfloat16 is 812 GB of weights; one node of 8 x H100 (80 GB) cannot hold it.
SERVICE = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "big"},
    "spec": {"model": {"uri": "hf://meta-llama/Llama-3.1-405B-Instruct"},
             "resources": {"gpu": {"type": "nvidia-h100-80gb"}}, "replicas": 2},
}
SELECTOR = "serving.tokenmill.dev/inferenceservice=big"


@pytest.fixture(scope="module")
def lws_controller(cluster: Cluster) -> Iterator[int]:
    yield start_lws(cluster)


def _env(pod: dict) -> dict[str, str]:
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    return {e["name"]: e.get("value", "") for e in engine.get("env") or []}


def test_multi_node_service_runs_as_lws_groups_across_gpu_nodes(
        cluster: Cluster, operator: OperatorProcess, lws_controller: int, namespace: str) -> None:
    # 16 GPUs per group (2 pods x 8): a quota of 24 admits one group of the two asked for, which only holds
    # if the cap counts every pod of a group.
    apply(cluster, {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
                    "spec": {"hard": {"requests.nvidia.com/gpu": "24"}}}, namespace)
    apply(cluster, SERVICE, namespace)

    obj = wait_for(lambda: (o := get(cluster, ISVC, "big", namespace)) and ready_for_current_generation(o) and o,
                   "the multi-node InferenceService to be Ready", timeout=120)
    sizing = obj["status"]["sizing"]
    assert (sizing["nodesPerReplica"], sizing["tensorParallelSize"], sizing["pipelineParallelSize"]) == (2, 8, 2)
    assert sizing["gpusPerReplica"] == 16
    assert obj["status"]["desiredReplicas"] == 1 and obj["status"]["readyReplicas"] == 1
    quota = condition(obj, "QuotaLimited")
    assert quota["status"] == "True" and "admits 1 replicas x 16 GPUs" in quota["message"]
    assert get(cluster, "deployment", "big", namespace) is None

    lws = get(cluster, "leaderworkersets.leaderworkerset.x-k8s.io", "big-lws", namespace)
    assert lws["spec"]["replicas"] == 1
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert lws["status"]["readyReplicas"] == 1

    pods = items(cluster, "pods", namespace, SELECTOR)
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    by_role = {p["metadata"]["labels"]["serving.tokenmill.dev/role"]: p for p in pods}
    leader, worker = by_role["leader"], by_role["worker"]
    # One pod per H100 node: each takes all 8 GPUs of its node.
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gpu-h100-0", "gpu-h100-1"]
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "8"
        args = engine["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "8"
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert "--headless" in next(c for c in worker["spec"]["containers"] if c["name"] == "engine")["args"]
    assert "--headless" not in next(c for c in leader["spec"]["containers"] if c["name"] == "engine")["args"]
    # The LWS pod webhook injected the group's launch environment into both pods.
    for pod, index in ((leader, "0"), (worker, "1")):
        env = _env(pod)
        assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == index
        assert env["LWS_LEADER_ADDRESS"].startswith(f"big-lws-0.big-lws.{namespace}")
    # Only the leader serves HTTP: the Service selects it alone.
    service = get(cluster, "service", "big", namespace)
    assert service["spec"]["selector"]["serving.tokenmill.dev/role"] == "leader"

    # A worker lost restarts the whole group (RecreateGroupOnPodRestart), and the service is Ready again.
    cluster.kubectl("delete", "pod", worker["metadata"]["name"], "-n", namespace, "--wait=false")
    wait_for(lambda: all(p["metadata"]["uid"] != leader["metadata"]["uid"]
                         for p in items(cluster, "pods", namespace, SELECTOR)),
             "the leader pod to be recreated with its group", timeout=90)
    wait_for(lambda: (o := get(cluster, ISVC, "big", namespace)) and ready_for_current_generation(o)
             and o["status"].get("readyReplicas") == 1 and o, "Ready again after the group restart", timeout=120)


# The bundled model, declared (spec.model.profile.parameters) as a 50B-parameter model: 100 GB of bfloat16
# weights need two H100s, and its 9 attention heads allow no tensor split, so the plan is PP 2 over two
# pods (nodes). Sizing believes the declared count; the engines load the real 135M weights, split in two
# pipeline stages: the operator's multi-node hand-over, executed on a CPU.
PIPELINED = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "piped"},
    "spec": {"model": {"uri": "bundled://smollm2-135m-instruct", "profile": {"parameters": 50_000_000_000}},
             "resources": {"gpu": {"type": "nvidia-h100-80gb"}}, "replicas": 1,
             "template": {"labels": {RUNNER_LABEL: "true"}}},
}


def test_multi_node_group_runs_leader_and_headless_worker_and_answers(
        cluster: Cluster, operator: OperatorProcess, lws_controller: int, pod_runner: PodRunner,
        namespace: str) -> None:
    apply(cluster, PIPELINED, namespace)
    obj, seen = wait_ready_sampling_kstatus(cluster, namespace, "piped")
    sizing = obj["status"]["sizing"]
    assert (sizing["nodesPerReplica"], sizing["tensorParallelSize"], sizing["pipelineParallelSize"]) == (2, 1, 2)
    assert seen[-1][2] == "Current", seen

    template = get(cluster, "leaderworkersets.leaderworkerset.x-k8s.io", "piped-lws", namespace)["spec"][
        "leaderWorkerTemplate"]
    pods = items(cluster, "pods", namespace, "serving.tokenmill.dev/inferenceservice=piped")
    by_role = {p["metadata"]["labels"]["serving.tokenmill.dev/role"]: p for p in pods}
    leader, worker = by_role["leader"], by_role["worker"]
    for pod, key in ((leader, "leaderTemplate"), (worker, "workerTemplate")):
        engine = next(c for c in template[key]["spec"]["containers"] if c["name"] == "engine")
        assert_runs_container_argv(engine, pod_runner, pod)
    run = pod_runner.worker(namespace, worker["metadata"]["name"]).containers[0]
    assert "--headless" in run.argv and "--pipeline-parallel-size" in run.argv
    # The launch environment the LWS webhook wrote, as the worker's engine got it: the leader's DNS name
    # became the leader pod's IP (no cluster DNS here), the rest as written.
    spec_env = _env(worker)
    assert spec_env["LWS_LEADER_ADDRESS"].startswith(f"piped-lws-0.piped-lws.{namespace}")
    assert run.env["LWS_LEADER_ADDRESS"] == leader["status"]["podIP"]
    assert (run.env["LWS_GROUP_SIZE"], run.env["LWS_WORKER_INDEX"]) == ("2", "1")

    # A completion through the official openai client: generated by both pipeline stages (the worker's
    # rank holds layers 15-29, so no token comes out without it).
    rsp = openai_completion(leader)
    assert rsp.choices[0].text and rsp.usage.completion_tokens >= 1, rsp
    # The worker's rank really ran: its log shows it joined and sized its stage's pool.
    log = run.log.read_text()
    assert "rank 1 (tp 0, pp 1) ready" in log, log[-3000:]
    assert pod_runner.all_errors() == []
