"""Operator chaos: the operator killed mid-reconcile, the kube-apiserver restarted, two spec edits racing,
a child Deployment deleted. Each time it converges to one correct set of children, never writes the
spec, and status follows the latest generation (judged by kstatus too, as Flux and kpt would).
Pods here are kwok's (instantly Ready, nothing runs): this is about the operator, not the engine."""

from __future__ import annotations

import json

from cluster import Cluster, restart_component
from e2e_helpers import ISVC, OperatorProcess, apply, get, items, ready_for_current_generation, wait_for
from gitops_tools import kstatus
from test_examples import apply_example

SERVICE = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "chat"},
    "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
             "resources": {"gpu": {"type": "nvidia-h100-80gb", "count": 1}}, "replicas": 2},
}
OUR_MANAGERS = ("kubectl",)  # the test's own edits (kubectl-client-side-apply, kubectl-patch)


def _args(obj: dict) -> list[str]:
    return obj["spec"]["template"]["spec"]["containers"][0]["args"]


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def converged(cluster: Cluster, namespace: str, generation: int, replicas: int,
              max_num_seqs: str | None = None) -> dict | None:
    """One Deployment, Service and PDB; one active ReplicaSet whose pods are all the pods; status Ready
    for `generation`; the Deployment carries what that generation asks for."""
    isvc = get(cluster, ISVC, "chat", namespace)
    if not (isvc and isvc["metadata"]["generation"] == generation and ready_for_current_generation(isvc)):
        return None
    deploys = items(cluster, "deployments", namespace)
    if len(deploys) != 1 or deploys[0]["spec"]["replicas"] != replicas:
        return None
    if max_num_seqs is not None and _arg(_args(deploys[0]), "--max-num-seqs") != max_num_seqs:
        return None
    active = [rs for rs in items(cluster, "replicasets", namespace) if rs["spec"].get("replicas")]
    pods = [p for p in items(cluster, "pods", namespace) if not p["metadata"].get("deletionTimestamp")]
    if len(active) != 1 or len(pods) != replicas:
        return None
    hash_ = active[0]["metadata"]["labels"]["pod-template-hash"]
    if any(p["metadata"]["labels"].get("pod-template-hash") != hash_ for p in pods):
        return None
    if len(items(cluster, "services", namespace)) != 1 or len(items(cluster, "poddisruptionbudgets", namespace)) != 1:
        return None
    if isvc["status"].get("readyReplicas") != replicas:
        return None
    return isvc


def wait_converged(cluster: Cluster, namespace: str, generation: int, replicas: int,
                   max_num_seqs: str | None = None) -> dict:
    isvc = wait_for(lambda: converged(cluster, namespace, generation, replicas, max_num_seqs),
                    f"one set of children for generation {generation} ({replicas} replicas)", timeout=120)
    assert kstatus([isvc])[0]["status"] == "Current", kstatus([isvc])
    assert_no_spec_written(isvc)
    return isvc


def assert_no_spec_written(isvc: dict) -> None:
    """Only the test's kubectl edits own spec fields; the operator writes status (and metadata) only."""
    for entry in isvc["metadata"].get("managedFields") or []:
        if entry.get("subresource") == "status" or entry["manager"].startswith(OUR_MANAGERS):
            continue
        assert "f:spec" not in (entry.get("fieldsV1") or {}), entry


def patch(cluster: Cluster, namespace: str, spec: dict) -> None:
    cluster.kubectl("patch", ISVC, "chat", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))


def test_operator_killed_mid_reconcile_converges_after_restart(
        cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    apply(cluster, SERVICE, namespace)
    # SIGKILL as soon as its first child exists: the pass that created it has not finished.
    wait_for(lambda: get(cluster, "deployment", "chat", namespace), "the operator to create the Deployment",
             timeout=60, interval=0.05)
    operator.proc.kill()
    operator.proc.wait(timeout=10)
    try:
        patch(cluster, namespace, {"replicas": 3})  # and the spec moves on while it is dead
    finally:
        operator.start()
    wait_converged(cluster, namespace, generation=2, replicas=3)


def test_apiserver_restart_then_edit_is_applied(cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    apply(cluster, SERVICE, namespace)
    wait_converged(cluster, namespace, generation=1, replicas=2)
    down_s = restart_component(cluster, "kube-apiserver")
    assert operator.proc.poll() is None, f"the operator exited when the API server restarted:\n{operator.log_tail()}"
    patch(cluster, namespace, {"engine": {"maxNumSeqs": 8}})
    isvc = wait_converged(cluster, namespace, generation=2, replicas=2, max_num_seqs="8")
    assert isvc["status"]["observedGeneration"] == 2, (isvc["status"], down_s)


def test_two_racing_spec_edits_end_at_the_latest_generation(
        cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    apply(cluster, SERVICE, namespace)
    wait_converged(cluster, namespace, generation=1, replicas=2)
    patch(cluster, namespace, {"replicas": 3})
    patch(cluster, namespace, {"engine": {"maxNumSeqs": 8}})  # before the operator finished the first
    isvc = get(cluster, ISVC, "chat", namespace)
    if (isvc.get("status") or {}).get("observedGeneration") != 3:
        assert kstatus([isvc])[0]["status"] == "InProgress", kstatus([isvc])
    isvc = wait_converged(cluster, namespace, generation=3, replicas=3, max_num_seqs="8")
    assert all(c.get("observedGeneration", 3) == 3 for c in isvc["status"]["conditions"]), isvc["status"]


def test_deleted_child_deployment_is_recreated_once(cluster: Cluster, operator: OperatorProcess,
                                                    namespace: str) -> None:
    apply(cluster, SERVICE, namespace)
    wait_converged(cluster, namespace, generation=1, replicas=2)
    old_uid = get(cluster, "deployment", "chat", namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "chat", "-n", namespace, "--wait=false")
    wait_for(lambda: (d := get(cluster, "deployment", "chat", namespace)) and d["metadata"]["uid"] != old_uid,
             "a new Deployment", timeout=60)
    wait_converged(cluster, namespace, generation=1, replicas=2)


def test_kstatus_reads_a_stalled_service_as_failed(cluster: Cluster, operator: OperatorProcess,
                                                  namespace: str) -> None:
    """The infeasible example (70B on one L4): Stalled=True, which kstatus reports as Failed."""
    name = apply_example(cluster, "infeasible-model.yaml", namespace)["metadata"]["name"]
    isvc = wait_for(lambda: (o := get(cluster, ISVC, name, namespace)) and
                    (o.get("status") or {}).get("observedGeneration") == 1 and o, "status for generation 1",
                    timeout=60)
    wait_for(lambda: kstatus([get(cluster, ISVC, name, namespace)])[0]["status"] == "Failed",
             "kstatus Failed", timeout=30)
    got = kstatus([get(cluster, ISVC, name, namespace)])[0]
    assert "GB" in got["message"], got  # kstatus shows the Stalled condition's message
    assert_no_spec_written(isvc)
