"""`kubectl apply` of every manifest in examples/, served by the operator running with the chart's RBAC."""

from __future__ import annotations

import json
import time

import yaml
from cluster import DEFAULT_NODES, Cluster
from e2e_helpers import (
    EXAMPLES,
    ISVC,
    OperatorProcess,
    condition,
    get,
    is_current,
    items,
    ready_for_current_generation,
    wait_for,
)

# SmolLM2-135M's config.json: 30 layers, 3 KV heads of dim 64, 8192 positions, 134,515,008 parameters.
SMOLLM2_KV_BYTES_PER_TOKEN_BF16 = 2 * 30 * 3 * 64 * 2  # K and V x layers x kv_heads x head_dim x 2 bytes
SMOLLM2_WEIGHTS_BYTES_BF16 = 134_515_008 * 2
SMOLLM2_MAX_POSITIONS = 8192
L4_MEMORY_BYTES = 23034 * 2**20  # nvidia-smi's memory.total for an L4, in MiB


def example(name: str, namespace: str) -> list[dict]:
    """The example's documents, moved into the test's namespace (the quota example names its own)."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    out = []
    for d in docs:
        if d["kind"] == "Namespace":
            continue
        d["metadata"]["namespace"] = namespace
        out.append(d)
    return out


def apply_example(cluster: Cluster, name: str, namespace: str) -> dict:
    docs = example(name, namespace)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return next(d for d in docs if d["kind"] == "InferenceService")


def args_map(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""], strict=True) if a.startswith("--")}


def engine_container(deploy: dict) -> dict:
    return deploy["spec"]["template"]["spec"]["containers"][0]


def running_pods(cluster: Cluster, namespace: str, name: str) -> list[dict]:
    pods = items(cluster, "pods", namespace, f"serving.tokenmill.dev/inferenceservice={name}")
    return [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


def test_bundled_model_on_one_gpu(cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    isvc = apply_example(cluster, "bundled-one-gpu.yaml", namespace)
    name = isvc["metadata"]["name"]
    obj = wait_for(lambda: (o := get(cluster, ISVC, name, namespace)) and ready_for_current_generation(o) and o,
                   "Ready=True for generation 1", timeout=90)
    assert obj["metadata"]["generation"] == 1 and obj["status"]["observedGeneration"] == 1
    assert condition(obj, "Sized")["status"] == "True"
    assert condition(obj, "Stalled")["status"] == "False"

    # The sizing, checked against hand-computed numbers rather than the operator's own functions.
    sizing = obj["status"]["sizing"]
    assert sizing["kvBytesPerToken"] == SMOLLM2_KV_BYTES_PER_TOKEN_BF16
    assert sizing["weightsBytes"] == SMOLLM2_WEIGHTS_BYTES_BF16
    assert sizing["gpusPerReplica"] == 1
    assert sizing["kvTokens"] == sizing["kvBlocks"] * sizing["blockSize"]
    assert sizing["kvCacheBytes"] == sizing["kvTokens"] * sizing["kvBytesPerToken"]
    assert sizing["kvCacheBytes"] + sizing["weightsBytes"] <= 0.9 * L4_MEMORY_BYTES
    assert sizing["maxModelLen"] <= SMOLLM2_MAX_POSITIONS and sizing["maxModelLen"] % sizing["blockSize"] == 0
    assert sizing["kvTokens"] >= sizing["maxModelLen"]

    # The child runs exactly what status says, on the one node pool that has L4s.
    deploy = get(cluster, "deployment", name, namespace)
    c = engine_container(deploy)
    args = args_map(c["args"])
    assert c["command"] == ["tokenmill", "serve"]
    assert int(args["--max-model-len"]) == sizing["maxModelLen"]
    assert int(args["--max-num-seqs"]) == sizing["maxNumSeqs"]
    assert int(args["--kv-cache-memory"]) == sizing["kvCacheBytes"]
    assert int(args["--block-size"]) == sizing["blockSize"]
    assert args["--dtype"] == "bfloat16"
    assert args["--model"] == "bundled://smollm2-135m-instruct"  # spec.model.uri, as written
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    owner = deploy["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("InferenceService", name, obj["metadata"]["uid"])
    svc = get(cluster, "service", name, namespace)
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000]
    assert get(cluster, "poddisruptionbudget", name, namespace) is None  # one replica: nothing to protect
    pods = running_pods(cluster, namespace, name)
    l4_nodes = {n.name for n in DEFAULT_NODES if n.gpu_product == "NVIDIA-L4"}
    assert len(pods) == 1 and pods[0]["spec"]["nodeName"] in l4_nodes
    assert obj["status"]["readyReplicas"] == 1 and obj["status"]["desiredReplicas"] == 1

    # A spec edit: new generation, the Deployment rolls, status follows the new generation.
    old_pod = pods[0]["metadata"]["name"]
    cluster.kubectl("patch", ISVC, name, "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 8}}}))

    def rolled() -> dict | None:
        o = get(cluster, ISVC, name, namespace)
        if not (o["metadata"]["generation"] == 2 and ready_for_current_generation(o)):
            return None
        pods = running_pods(cluster, namespace, name)
        new = [p for p in pods if args_map(p["spec"]["containers"][0]["args"]).get("--max-num-seqs") == "8"]
        return o if len(pods) == 1 and new and new[0]["metadata"]["name"] != old_pod else None

    obj = wait_for(rolled, "the rollout of generation 2 and Ready=True for it", timeout=120)
    assert obj["status"]["observedGeneration"] == 2
    assert obj["status"]["sizing"]["maxNumSeqs"] == 8
    assert all(c.get("observedGeneration", 2) == 2 for c in obj["status"]["conditions"])
    assert get(cluster, "pod", old_pod, namespace) is None


def test_autoscaled_example_holds_at_min_when_pod_metrics_are_unreachable(
        cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    """Fake pods serve no /metrics: the operator must hold (not flap, not crash) and say why."""
    isvc = apply_example(cluster, "autoscaled.yaml", namespace)
    name = isvc["metadata"]["name"]
    obj = wait_for(lambda: (o := get(cluster, ISVC, name, namespace)) and ready_for_current_generation(o)
                   and condition(o, "ScalingActive")["reason"] not in ("WaitingForMetrics",) and o,
                   "Ready=True and a scaling decision", timeout=90)
    scaling = condition(obj, "ScalingActive")
    assert scaling["status"] == "False", scaling
    assert "Metrics" in scaling["reason"] and "holding at 1" in scaling["message"], scaling
    deploy = get(cluster, "deployment", name, namespace)
    assert deploy["spec"]["replicas"] == isvc["spec"]["scaling"]["minReplicas"]
    # maxReplicas > 1: a PodDisruptionBudget protects the service while it may run several replicas.
    assert get(cluster, "poddisruptionbudget", name, namespace) is not None
    h100_nodes = {n.name for n in DEFAULT_NODES if n.gpu_product.startswith("NVIDIA-H100")}
    assert {p["spec"]["nodeName"] for p in running_pods(cluster, namespace, name)} <= h100_nodes


def test_infeasible_model_is_refused_before_any_pod(cluster: Cluster, operator: OperatorProcess,
                                                    namespace: str) -> None:
    isvc = apply_example(cluster, "infeasible-model.yaml", namespace)
    name = isvc["metadata"]["name"]
    obj = wait_for(lambda: (o := get(cluster, ISVC, name, namespace)) and is_current(o)
                   and condition(o, "Sized") and o, "a Sized condition", timeout=60)
    sized = condition(obj, "Sized")
    assert sized["status"] == "False" and sized["reason"] != "Fits", sized
    # The message carries the numbers: Llama-3.1-70B is ~141 GB of bf16 weights, an L4 has ~24 GB.
    assert "GB" in sized["message"] and "l4" in sized["message"].lower(), sized["message"]
    assert obj["status"]["sizing"]["feasible"] is False
    assert obj["status"]["sizing"]["weightsBytes"] > 24 * 10**9
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "Stalled")["status"] == "True"
    # Nothing was created for it, also not after a few more reconcile passes (the test interval is 2 s).
    time.sleep(6)
    assert get(cluster, "deployment", name, namespace) is None
    assert items(cluster, "pods", namespace) == []


def test_gpu_quota_caps_replicas_without_stuck_pods(cluster: Cluster, operator: OperatorProcess,
                                                   namespace: str) -> None:
    docs = example("quota-limited-namespace.yaml", namespace)
    quota = next(d for d in docs if d["kind"] == "ResourceQuota")
    isvc = next(d for d in docs if d["kind"] == "InferenceService")
    allowed_gpus = int(quota["spec"]["hard"]["requests.nvidia.com/gpu"])
    per_replica = isvc["spec"]["resources"]["gpu"]["count"]
    expected = allowed_gpus // per_replica
    assert expected < isvc["spec"]["replicas"], "the example must ask for more than the quota allows"
    apply_example(cluster, "quota-limited-namespace.yaml", namespace)
    name = isvc["metadata"]["name"]

    def capped() -> dict | None:
        o = get(cluster, ISVC, name, namespace)
        q = condition(o, "QuotaLimited")
        return o if is_current(o) and q and q["status"] == "True" and \
            len(running_pods(cluster, namespace, name)) == expected else None

    obj = wait_for(capped, f"QuotaLimited=True and {expected} running pods", timeout=90)
    q = condition(obj, "QuotaLimited")
    assert str(allowed_gpus) in q["message"], q
    assert obj["status"]["desiredReplicas"] == expected
    assert get(cluster, "deployment", name, namespace)["spec"]["replicas"] == expected
    pods = items(cluster, "pods", namespace)
    assert [p["status"]["phase"] for p in pods] == ["Running"] * expected  # nothing Pending
    events = items(cluster, "events", namespace)
    refused = [e for e in events if e.get("reason") == "FailedCreate" or "exceeded quota" in e.get("message", "")]
    assert refused == [], [e["message"] for e in refused]
    used = get(cluster, "resourcequota", quota["metadata"]["name"], namespace)["status"]["used"]
    assert int(used["requests.nvidia.com/gpu"]) == expected * per_replica
