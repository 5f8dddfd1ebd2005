"""Drift, operator restarts and deletion: the operator converges, changes nothing it should not, and
deleting an InferenceService removes every child."""

from __future__ import annotations

import json
import time

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

SERVICE = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "chat"},
    "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
             "resources": {"gpu": {"type": "nvidia-h100-80gb", "count": 1}}, "replicas": 2},
}
CHILDREN = (("deployment", "Deployment"), ("service", "Service"), ("poddisruptionbudget", "PodDisruptionBudget"))


def _ready(cluster: Cluster, namespace: str, generation: int) -> dict:
    return wait_for(lambda: (o := get(cluster, ISVC, "chat", namespace)) and o["metadata"]["generation"] == generation
                    and ready_for_current_generation(o) and o["status"].get("readyReplicas") == o["status"].get(
                        "desiredReplicas") and o, f"Ready=True for generation {generation}", timeout=90)


def _snapshot(cluster: Cluster, namespace: str) -> dict:
    snap = {kind: get(cluster, res, "chat", namespace)["metadata"]["resourceVersion"] for res, kind in CHILDREN}
    deploy = get(cluster, "deployment", "chat", namespace)
    snap["deployment-generation"] = deploy["metadata"]["generation"]
    snap["pods"] = sorted(p["metadata"]["name"] for p in items(cluster, "pods", namespace))
    isvc = get(cluster, ISVC, "chat", namespace)
    snap["conditions"] = {c["type"]: (c["status"], c["reason"], c["lastTransitionTime"])
                          for c in isvc["status"]["conditions"]}
    return snap


def _operator_events(cluster: Cluster, namespace: str) -> list[tuple[str, str]]:
    return sorted((e["reason"], e["message"]) for e in items(cluster, "events", namespace)
                  if (e.get("source") or {}).get("component") == "tokenmill-operator"
                  or e.get("reportingComponent") == "tokenmill-operator")


def test_restart_is_idempotent_and_edits_made_while_down_are_applied(
        cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    apply(cluster, SERVICE, namespace)
    _ready(cluster, namespace, 1)
    time.sleep(3 * 2)  # a few reconcile passes (interval 2 s) so everything has settled
    before, events_before = _snapshot(cluster, namespace), _operator_events(cluster, namespace)

    operator.restart()
    time.sleep(4 * 2)
    # A restarted operator re-reconciles everything it lists, and must find nothing to change.
    assert _snapshot(cluster, namespace) == before
    assert _operator_events(cluster, namespace) == events_before

    # Edits made while the operator is down are picked up when it comes back.
    operator.stop()
    cluster.kubectl("patch", ISVC, "chat", "-n", namespace, "--type=merge", "-p", '{"spec": {"replicas": 3}}')
    time.sleep(2)
    assert get(cluster, "deployment", "chat", namespace)["spec"]["replicas"] == 2  # nobody acted yet
    operator.start()
    obj = _ready(cluster, namespace, 2)
    assert obj["status"]["desiredReplicas"] == 3 and obj["status"]["readyReplicas"] == 3
    assert get(cluster, "deployment", "chat", namespace)["spec"]["replicas"] == 3


def test_drift_on_children_is_corrected(cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    apply(cluster, SERVICE, namespace)
    _ready(cluster, namespace, 1)
    # Someone scales the Deployment and changes the engine arguments by hand.
    deploy = get(cluster, "deployment", "chat", namespace)
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    patch = {"spec": {"replicas": 5, "template": {"spec": {"containers": [
        {"name": "engine", "args": [*args, "--max-waiting-requests", "1"]}]}}}}
    cluster.kubectl("patch", "deployment", "chat", "-n", namespace, "--type=strategic", "-p", json.dumps(patch))
    wait_for(lambda: (d := get(cluster, "deployment", "chat", namespace))["spec"]["replicas"] == 2
             and d["spec"]["template"]["spec"]["containers"][0]["args"] == args,
             "the operator to put the Deployment back", timeout=60)
    # The Service deleted by hand comes back.
    cluster.kubectl("delete", "service", "chat", "-n", namespace)
    wait_for(lambda: get(cluster, "service", "chat", namespace), "the Service to be recreated", timeout=60)
    obj = _ready(cluster, namespace, 1)
    assert condition(obj, "Stalled")["status"] == "False"


def test_deleting_the_inference_service_removes_all_children(
        cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    log_start = len(operator.log_text())
    apply(cluster, SERVICE, namespace)
    _ready(cluster, namespace, 1)
    for res, _ in CHILDREN:
        assert get(cluster, res, "chat", namespace) is not None, res
    assert len(items(cluster, "pods", namespace)) == 2
    cluster.kubectl("delete", ISVC, "chat", "-n", namespace, "--wait=true", "--timeout=60s")

    def all_gone() -> bool:
        left = [res for res, _ in CHILDREN if get(cluster, res, "chat", namespace) is not None]
        left += [p["metadata"]["name"] for p in items(cluster, "pods", namespace)]
        left += [r["metadata"]["name"] for r in items(cluster, "replicasets", namespace)]
        return not left

    wait_for(all_gone, "garbage collection of every child", timeout=90)
    # And the operator does not bring anything back.
    time.sleep(3 * 2)
    assert all_gone()
    assert "Traceback" not in operator.log_text()[log_start:], operator.log_text()[log_start:][-3000:]
