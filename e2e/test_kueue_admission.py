"""Kueue admission of InferenceServices with the real Kueue controller (v0.19.2, e2e/kueue_controller.py)
and the operator on the chart's RBAC: the queue label reaches the Deployment, Kueue gates and admits the
engine pods against a 2-GPU ClusterQueue, and the InferenceService's status says what Kueue decided
(docs/operator.md, "GPU quotas for platform teams"). kwok's pods are Ready once bound, so no engine runs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import yaml
from cluster import Cluster, Tools
from e2e_helpers import (
    CHART,
    EXAMPLES,
    ISVC,
    OPERATOR_NAMESPACE,
    RELEASE,
    OperatorProcess,
    apply,
    condition,
    get,
    items,
    wait_for,
)
from test_chart import _docs, _template

GPU = "nvidia.com/gpu"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
GATE = "kueue.x-k8s.io/admission"
QUOTA = 2  # GPUs in the ClusterQueue


def _kueue_rules(docs: list[dict]) -> dict[str, list[dict]]:
    """Rules naming Kueue's API group or Events' list, by (Cluster)Role name."""
    out = {}
    for d in docs:
        if d["kind"] in ("ClusterRole", "Role"):
            rules = [r for r in d["rules"] if "kueue.x-k8s.io" in r["apiGroups"] or
                     ("events" in r["resources"] and "list" in r["verbs"])]
            if rules:
                out[f"{d['kind']}/{d['metadata'].get('namespace', '')}/{d['metadata']['name']}"] = rules
    return out


@pytest.mark.parametrize(("args", "expected"), [
    ([], False),  # rbac.kueue=auto, and helm template's API server serves no Kueue
    (["--api-versions", "kueue.x-k8s.io/v1beta2"], True),  # auto, with Kueue's API discovered
    (["--set", "rbac.kueue=true"], True),
    (["--set", "rbac.kueue=false", "--api-versions", "kueue.x-k8s.io/v1beta2"], False),
])
def test_chart_grants_kueue_reads_when_kueue_is_there(tools: Tools, args: list[str], expected: bool) -> None:
    rules = _kueue_rules(_docs(_template(tools, *args).stdout))
    if not expected:
        assert rules == {}
        return
    [only] = rules.values()
    assert {res: r["verbs"] for r in only for res in r["resources"]} == {
        "localqueues": ["get", "list", "watch"], "workloads": ["get", "list", "watch"],
        "clusterqueues": ["get", "list", "watch"], "events": ["list"]}


def test_namespaced_chart_reads_cluster_queues_through_its_one_cluster_role(tools: Tools) -> None:
    docs = _docs(_template(tools, "--set", "watchNamespaces={team-a,team-b}", "--set", "rbac.kueue=true").stdout)
    rules = _kueue_rules(docs)
    assert set(rules) == {"Role/team-a/tm-tokenmill-operator", "Role/team-b/tm-tokenmill-operator",
                          "ClusterRole//tm-tokenmill-operator-kueue"}, set(rules)
    assert rules["ClusterRole//tm-tokenmill-operator-kueue"] == [
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["clusterqueues"], "verbs": ["get", "list", "watch"]}]
    [binding] = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "tm-tokenmill-operator-kueue"


def test_chart_refuses_a_kueue_value_that_is_neither_auto_nor_a_boolean(tools: Tools) -> None:
    proc = _template(tools, "--set", "rbac.kueue=sometimes", check=False)
    assert proc.returncode != 0 and "/rbac/kueue" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def kueue_operator(cluster: Cluster, kueue: int, operator: OperatorProcess) -> OperatorProcess:
    """The session's operator with the chart's Kueue rules. `kueue` comes first, so a chart installed by this
    module sees Kueue's API (rbac.kueue=auto); one installed earlier in the session is upgraded to add them."""
    role = get(cluster, "clusterrole", RELEASE)
    if not any("clusterqueues" in r.get("resources", []) for r in role["rules"]):
        cluster.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "--reuse-values", "--wait",
                     "--timeout", "120s")
        role = get(cluster, "clusterrole", RELEASE)
    kueue_rules = [r for r in role["rules"] if "kueue.x-k8s.io" in r["apiGroups"]]
    assert {res for r in kueue_rules for res in r["resources"]} == {"localqueues", "workloads", "clusterqueues"}
    assert all(r["verbs"] == ["get", "list", "watch"] for r in kueue_rules), kueue_rules
    return operator


@pytest.fixture
def queue(cluster: Cluster, kueue_operator: OperatorProcess, namespace: str) -> Iterator[str]:
    """A ClusterQueue with QUOTA GPUs (and enough CPU and memory: Kueue admits only what its resourceGroups
    cover, and the engine pods request all three), preempting lower priorities within it; the LocalQueue
    `gpus` in the test's namespace. Yields the ClusterQueue's name."""
    name = f"cq-{namespace}"
    apply(cluster, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name}})
    apply(cluster, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
                    "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                             "resourceGroups": [{"coveredResources": ["cpu", "memory", GPU], "flavors": [
                                 {"name": name, "resources": [{"name": "cpu", "nominalQuota": 64},
                                                              {"name": "memory", "nominalQuota": "1Ti"},
                                                              {"name": GPU, "nominalQuota": QUOTA}]}]}]}})
    apply(cluster, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                    "metadata": {"name": "gpus", "namespace": namespace}, "spec": {"clusterQueue": name}})
    wait_for(lambda: (condition(get(cluster, "clusterqueue", name), "Active") or {}).get("status") == "True",
             f"ClusterQueue {name} Active")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "clusterqueue", name, "--wait=false", "--ignore-not-found", check=False)
        cluster.kubectl("delete", "resourceflavor", name, "--wait=false", "--ignore-not-found", check=False)


def service(name: str, replicas: int | None = None, priority: str | None = None, scaling: dict | None = None) -> dict:
    labels = {QUEUE_LABEL: "gpus", **({PRIORITY_LABEL: priority} if priority else {})}
    size = {"scaling": scaling} if scaling else {"replicas": replicas}
    return {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "labels": labels},
            "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
                     "resources": {"gpu": {"type": "nvidia-h100-80gb", "count": 1}}, **size}}


def isvc(cluster: Cluster, name: str, namespace: str) -> dict | None:
    return get(cluster, ISVC, name, namespace)


def reason(cluster: Cluster, name: str, namespace: str, type_: str) -> str | None:
    return (condition(isvc(cluster, name, namespace), type_) or {}).get("reason")


def pods(cluster: Cluster, namespace: str, name: str) -> list[dict]:
    return items(cluster, "pods", namespace, f"serving.tokenmill.dev/inferenceservice={name}")


def gated(pod: dict) -> bool:
    return GATE in [g["name"] for g in pod["spec"].get("schedulingGates") or []]


def events(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    return {e["reason"]: e["message"] for e in items(cluster, "events", namespace)
            if e["involvedObject"]["kind"] == "InferenceService" and e["involvedObject"]["name"] == name}


def test_admitted_within_the_queue_and_the_next_service_waits_queued_by_kueue(
        cluster: Cluster, queue: str, namespace: str) -> None:
    apply(cluster, service("first", replicas=2), namespace)
    dep = wait_for(lambda: get(cluster, "deployment", "first", namespace), "first's Deployment")
    assert dep["metadata"]["labels"][QUEUE_LABEL] == "gpus"
    # Kueue's Deployment webhook marked the template; that is not drift the operator reverts.
    assert dep["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/managed"] == "true"
    first = wait_for(lambda: (o := isvc(cluster, "first", namespace)) and
                     (condition(o, "Ready") or {}).get("status") == "True" and
                     (condition(o, "Admitted") or {}).get("status") == "True" and o, "first Ready and Admitted")
    admitted = condition(first, "Admitted")["message"]
    assert admitted.startswith(f"2 pods admitted by ClusterQueue {queue} (2 {GPU})"), admitted
    generation = get(cluster, "deployment", "first", namespace)["metadata"]["generation"]

    apply(cluster, service("second", replicas=1), namespace)
    second = wait_for(lambda: (o := isvc(cluster, "second", namespace)) and
                      (condition(o, "Ready") or {}).get("reason") == "QueuedByKueue" and o, "second QueuedByKueue")
    message = condition(second, "Admitted")["message"]
    assert condition(second, "Admitted")["reason"] == "QueuedByKueue"
    for text in (f"LocalQueue gpus -> ClusterQueue {queue}", f"ask for 1 {GPU}",
                 f"has 0 of {QUOTA} {GPU} free ({QUOTA} in use)"):
        assert text in message, message
    assert re.search(rf"insufficient unused quota for {GPU} in flavor {queue}, 1 more needed", message), message
    assert condition(second, "Stalled")["status"] == "False"  # waiting in a queue is not PodsBlocked
    assert condition(second, "Reconciling")["reason"] == "QueuedByKueue"
    [held] = pods(cluster, namespace, "second")
    assert gated(held) and not held["spec"].get("nodeName")  # runs no pod
    # The operator never rewrote first's Deployment meanwhile (Kueue's template fields are not drift).
    assert get(cluster, "deployment", "first", namespace)["metadata"]["generation"] == generation

    cluster.kubectl("delete", ISVC, "first", "-n", namespace)
    second = wait_for(lambda: (o := isvc(cluster, "second", namespace)) and
                      (condition(o, "Ready") or {}).get("status") == "True" and o, "second Ready", timeout=90)
    assert condition(second, "Admitted")["reason"] == "Admitted"
    assert "Admitted" in events(cluster, namespace, "second")


def test_a_queue_change_on_an_admitted_service_is_refused(cluster: Cluster, queue: str, namespace: str) -> None:
    apply(cluster, service("chat", replicas=1), namespace)
    wait_for(lambda: (condition(isvc(cluster, "chat", namespace), "Ready") or {}).get("status") == "True",
             "chat Ready")
    cluster.kubectl("label", ISVC, "chat", "-n", namespace, f"{QUEUE_LABEL}=elsewhere", "--overwrite")
    stalled = wait_for(lambda: (c := condition(isvc(cluster, "chat", namespace), "Stalled")) and
                       c["reason"] == "QueueChangeRefused" and c, "QueueChangeRefused")
    assert f"{QUEUE_LABEL}=elsewhere cannot be applied" in stalled["message"], stalled
    assert "runs in LocalQueue gpus with 1 ready replicas" in stalled["message"], stalled
    assert get(cluster, "deployment", "chat", namespace)["metadata"]["labels"][QUEUE_LABEL] == "gpus"
    assert not [p for p in pods(cluster, namespace, "chat") if gated(p)]  # still serving


def test_a_multi_node_replica_is_admitted_as_one_group(cluster: Cluster, queue: str, namespace: str) -> None:
    # The bundled model declared as 50B parameters plans PP 2 over two H100 pods (test_multinode.py): each
    # replica is a LeaderWorkerSet group of two 1-GPU pods, so the 2-GPU queue admits one of two groups.
    body = service("piped", replicas=2)
    body["spec"]["model"]["profile"] = {"parameters": 50_000_000_000}
    del body["spec"]["resources"]["gpu"]["count"]
    apply(cluster, body, namespace)
    obj = wait_for(lambda: (o := isvc(cluster, "piped", namespace)) and
                   (condition(o, "Admitted") or {}).get("reason") == "QueuedByKueue" and
                   (o.get("status") or {}).get("readyReplicas") == 1 and o,
                   "one group ready, the other QueuedByKueue", timeout=90)
    assert obj["status"]["sizing"]["nodesPerReplica"] == 2
    lws = get(cluster, "leaderworkersets.leaderworkerset.x-k8s.io", "piped-lws", namespace)
    assert lws["metadata"]["labels"][QUEUE_LABEL] == "gpus"
    message = condition(obj, "Admitted")["message"]
    assert f"Kueue holds 1 of 2 groups ({GATE} gate)" in message and f"ask for 2 {GPU} (2 per replica)" in message
    assert condition(obj, "Ready")["reason"] == "QueuedByKueue"

    def by_group() -> list[list[bool]]:
        out: dict[str, list[bool]] = {}
        for p in pods(cluster, namespace, "piped"):
            out.setdefault(p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-index"], []).append(gated(p))
        return sorted(sorted(g) for g in out.values())

    # The held group's worker pod may come a moment after its leader (the LWS controller's StatefulSet).
    wait_for(lambda: by_group() == [[False, False], [True, True]] or None,
             "one group's pods all running, the other's all gated")


def test_high_priority_preempts_low_priority_and_both_statuses_say_so(
        cluster: Cluster, queue: str, namespace: str, priorities: tuple[str, str]) -> None:
    low, high = priorities
    apply(cluster, service("batch", replicas=2, priority=low), namespace)
    wait_for(lambda: reason(cluster, "batch", namespace, "Admitted") == "Admitted", "batch admitted")
    apply(cluster, service("urgent", replicas=1, priority=high), namespace)
    urgent = wait_for(lambda: (o := isvc(cluster, "urgent", namespace)) and
                      (condition(o, "Ready") or {}).get("status") == "True" and
                      "admitted by preempting" in condition(o, "Admitted")["message"] and o,
                      "urgent Ready, admitted by preempting")
    batch = wait_for(lambda: (o := isvc(cluster, "batch", namespace)) and
                     (condition(o, "Admitted") or {}).get("reason") == "Preempted" and o, "batch Preempted")
    victim = re.search(r"admitted by preempting (\S+)", condition(urgent, "Admitted")["message"]).group(1)
    assert victim.startswith("pod-batch-"), victim
    preempted = condition(batch, "Admitted")["message"]
    assert "due to prioritization in the ClusterQueue" in preempted, preempted
    assert f"Kueue holds 1 of 2 pods ({GATE} gate)" in preempted, preempted
    assert condition(batch, "Ready")["reason"] == "QueuedByKueue"
    assert "Preempted" in events(cluster, namespace, "batch")
    # The preempted replica waits in the queue: the Deployment keeps 2 replicas, one of them gated.
    assert get(cluster, "deployment", "batch", namespace)["spec"]["replicas"] == 2
    assert sorted(gated(p) for p in pods(cluster, namespace, "batch")) == [False, True]


def test_autoscaled_service_stops_at_the_queue_quota_with_scaling_limited(
        cluster: Cluster, queue: str, namespace: str, tmp_path) -> None:
    from engines import start_prometheus

    # The real Prometheus answering a custom query with a constant total queue depth of 40: with a target
    # of 10 per replica the autoscaler wants 4 replicas, where the ClusterQueue admits 2 of 1 GPU.
    prometheus, url = start_prometheus(tmp_path, tmp_path / "targets.json")
    try:
        apply(cluster, service("chat", scaling={
            "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 10, "scaleUpStabilizationSeconds": 0,
            "metrics": {"source": "prometheus", "url": url, "query": "vector(40)"}}), namespace)
        limited = wait_for(lambda: (c := condition(isvc(cluster, "chat", namespace), "ScalingLimited")) and
                           c["status"] == "True" and c, "ScalingLimited=True", timeout=90)
        assert limited["reason"] == "QueueQuota", limited
        assert f"the autoscaler wants 4 replicas; ClusterQueue {queue} admits 2 replicas x 1 {GPU}" in \
            limited["message"], limited
        assert "held at 2 (the ClusterQueue bound holds)" in limited["message"], limited
        wait_for(lambda: (condition(isvc(cluster, "chat", namespace), "Ready") or {}).get("status") == "True",
                 "chat Ready at 2 replicas")
        assert get(cluster, "deployment", "chat", namespace)["spec"]["replicas"] == 2
        assert not [p for p in pods(cluster, namespace, "chat") if gated(p)]  # nothing asked beyond the queue
    finally:
        prometheus.stop()


def test_the_cluster_queue_example_admits_its_service(cluster: Cluster, kueue_operator: OperatorProcess,
                                                       namespace: str) -> None:
    """examples/kueue-cluster-queue.yaml as written, but in the test's namespace, with the cluster-scoped
    objects renamed after it (so that tests never share a ClusterQueue)."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "kueue-cluster-queue.yaml").read_text())
            if d and d["kind"] != "Namespace"]
    suffix = f"-{namespace}"
    renamed = {d["metadata"]["name"]: d["metadata"]["name"] + suffix for d in docs
               if d["kind"] in ("ResourceFlavor", "ClusterQueue", "WorkloadPriorityClass")}
    for d in docs:
        meta = d["metadata"]
        if d["kind"] in ("ResourceFlavor", "ClusterQueue", "WorkloadPriorityClass"):
            meta["name"] = renamed[meta["name"]]
        else:
            meta["namespace"] = namespace
        if d["kind"] == "ClusterQueue":
            d["spec"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] = namespace
            for group in d["spec"]["resourceGroups"]:
                for flavor in group["flavors"]:
                    flavor["name"] = renamed[flavor["name"]]
        if d["kind"] == "LocalQueue":
            d["spec"]["clusterQueue"] = renamed[d["spec"]["clusterQueue"]]
        if d["kind"] == "InferenceService":
            meta["labels"][PRIORITY_LABEL] = renamed[meta["labels"][PRIORITY_LABEL]]
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        cq = renamed["team-kueue"]
        obj = wait_for(lambda: (o := isvc(cluster, "chat", namespace)) and
                       (condition(o, "Ready") or {}).get("status") == "True" and o, "the example's service Ready")
        admitted = condition(obj, "Admitted")
        assert admitted["status"] == "True", admitted
        assert admitted["message"].startswith(f"2 pods admitted by ClusterQueue {cq} (2 {GPU})"), admitted
        assert f"ClusterQueue {cq} has 0 of 2 {GPU} free (2 in use)" in admitted["message"], admitted
        dep = get(cluster, "deployment", "chat", namespace)
        assert dep["metadata"]["labels"][PRIORITY_LABEL] == renamed["inference-high"]
        [wl, _] = [w for w in items(cluster, "workloads.kueue.x-k8s.io", namespace)]
        assert wl["spec"]["priority"] == 1000, wl["spec"]
    finally:
        for kind in ("clusterqueue", "resourceflavor", "workloadpriorityclass"):
            names = [n for n, d in ((d["metadata"]["name"], d) for d in docs) if d["kind"].lower() == kind]
            cluster.kubectl("delete", kind, *names, "--wait=false", "--ignore-not-found", check=False)
