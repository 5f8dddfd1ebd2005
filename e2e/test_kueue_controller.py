"""The real Kueue controller manager (sigs.k8s.io/kueue v0.19.2, built from the Go module proxy by
e2e/build_kueue.sh, run by e2e/kueue_controller.py) admitting plain workloads against a GPU quota: no
tokenmill operator here, only what Kueue's own webhooks and controllers do to Deployments and
LeaderWorkerSets, which the operator will build on (docs/e2e.md, "Kueue beside the cluster")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import Cluster
from e2e_helpers import apply, condition, get, items, wait_for

GPU = "nvidia.com/gpu"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
GATE = "kueue.x-k8s.io/admission"
QUOTA = 2


def _pod_spec(gpus: int) -> dict:
    # Only GPUs are requested: the ClusterQueue covers only nvidia.com/gpu, and a request for a resource it
    # does not cover would make the workload inadmissible.
    return {"containers": [{"name": "engine", "image": "tokenmill/engine:e2e",
                            "resources": {"limits": {GPU: str(gpus)}}}]}


def deployment(name: str, gpus: int, queue: str = "gpus", priority: str | None = None) -> dict:
    labels = {QUEUE_LABEL: queue, **({PRIORITY_LABEL: priority} if priority else {})}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": _pod_spec(gpus)}}}


def leader_worker_set(name: str, replicas: int, gpus_per_pod: int, queue: str = "gpus") -> dict:
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "labels": {QUEUE_LABEL: queue}},
            "spec": {"replicas": replicas, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": {"size": 2,
                                              "leaderTemplate": {"spec": _pod_spec(gpus_per_pod)},
                                              "workerTemplate": {"spec": _pod_spec(gpus_per_pod)}}}}


@pytest.fixture
def queue(cluster: Cluster, kueue: int, namespace: str) -> Iterator[str]:
    """A ResourceFlavor, a ClusterQueue with QUOTA GPUs (preempting lower priorities within it) and the
    LocalQueue `gpus` in the test's namespace; yields the ClusterQueue's name."""
    name = f"cq-{namespace}"
    apply(cluster, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name}})
    apply(cluster, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
                    "spec": {"namespaceSelector": {},
                             "preemption": {"withinClusterQueue": "LowerPriority"},
                             "resourceGroups": [{"coveredResources": [GPU], "flavors": [
                                 {"name": name, "resources": [{"name": GPU, "nominalQuota": QUOTA}]}]}]}})
    apply(cluster, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                    "metadata": {"name": "gpus", "namespace": namespace}, "spec": {"clusterQueue": name}})
    wait_for(lambda: (condition(get(cluster, "clusterqueue", name), "Active") or {}).get("status") == "True",
             f"ClusterQueue {name} Active")
    try:
        yield name
    finally:
        # Kueue holds a ClusterQueue (finalizer) while workloads use it: they go with the namespace after this.
        cluster.kubectl("delete", "clusterqueue", name, "--wait=false", "--ignore-not-found", check=False)
        cluster.kubectl("delete", "resourceflavor", name, "--wait=false", "--ignore-not-found", check=False)


def pods(cluster: Cluster, namespace: str, selector: str) -> list[dict]:
    return items(cluster, "pods", namespace, selector)


def gated(pod: dict) -> bool:
    return GATE in [g["name"] for g in pod["spec"].get("schedulingGates") or []]


def workloads(cluster: Cluster, namespace: str) -> list[dict]:
    return items(cluster, "workloads.kueue.x-k8s.io", namespace)


def admitted(wl: dict) -> bool:
    return (condition(wl, "Admitted") or {}).get("status") == "True"


def workload_of_pod(cluster: Cluster, namespace: str, pod: dict) -> dict | None:
    """The Workload that owns this pod (Kueue's pod integration makes one per pod of a Deployment)."""
    for wl in workloads(cluster, namespace):
        if any(o["uid"] == pod["metadata"]["uid"] for o in wl["metadata"].get("ownerReferences") or []):
            return wl
    return None


def gpu_usage(cq: dict) -> tuple[str, str]:
    """(total, borrowed) GPUs in use in the ClusterQueue's status."""
    for flavor in cq["status"].get("flavorsUsage") or []:
        for r in flavor["resources"]:
            if r["name"] == GPU:
                return r["total"], r.get("borrowed", "0")
    return "0", "0"


def test_deployment_admitted_within_quota_and_the_next_waits_until_it_is_deleted(
        cluster: Cluster, queue: str, namespace: str) -> None:
    apply(cluster, deployment("first", gpus=2), namespace)
    # Kueue's Deployment webhook marks the pod template: its pods are managed, in the queue, held by the parent.
    template = get(cluster, "deployment", "first", namespace)["spec"]["template"]["metadata"]
    assert template["labels"]["kueue.x-k8s.io/managed"] == "true"
    assert template["labels"][QUEUE_LABEL] == "gpus"
    assert template["annotations"]["kueue.x-k8s.io/pod-suspending-parent"] == "deployment"

    first = wait_for(lambda: [p for p in pods(cluster, namespace, "app=first")
                              if not gated(p) and p["spec"].get("nodeName")], "first's pod admitted and bound")[0]
    # One Workload per pod, controlled by the pod, named after it; the admitted pod names it and its queues.
    wl = wait_for(lambda: workload_of_pod(cluster, namespace, first), "the Workload of first's pod")
    assert wl["metadata"]["name"].startswith(f"pod-{first['metadata']['name']}-")
    assert [(o["kind"], o.get("controller")) for o in wl["metadata"]["ownerReferences"]] == [("Pod", True)]
    assert admitted(wl), wl["status"]
    assert wl["spec"]["queueName"] == "gpus"
    assert wl["status"]["admission"]["clusterQueue"] == queue
    assert first["metadata"]["annotations"]["kueue.x-k8s.io/workload"] == wl["metadata"]["name"]
    assert first["metadata"]["labels"]["kueue.x-k8s.io/cluster-queue-name"] == queue

    apply(cluster, deployment("second", gpus=1), namespace)
    second = wait_for(lambda: pods(cluster, namespace, "app=second"), "second's pod")[0]
    assert gated(second) and not second["spec"].get("nodeName")
    wl2 = wait_for(lambda: (w := workload_of_pod(cluster, namespace, second)) and
                   condition(w, "QuotaReserved") and w, "the Workload of second's pod, evaluated")
    assert not admitted(wl2)
    reserved = condition(wl2, "QuotaReserved")
    assert reserved["status"] == "False" and reserved["reason"] == "Pending", reserved
    assert reserved["message"] == (f"couldn't assign flavors to pod set main: insufficient unused quota for {GPU} "
                                   f"in flavor {queue}, 1 more needed"), reserved
    cq = wait_for(lambda: (c := get(cluster, "clusterqueue", queue)) and
                  c["status"].get("pendingWorkloads") == 1 and c, "the ClusterQueue counting one pending")
    assert gpu_usage(cq) == (str(QUOTA), "0")
    assert cq["status"]["admittedWorkloads"] == 1

    cluster.kubectl("delete", "deployment", "first", "-n", namespace)
    wait_for(lambda: not pods(cluster, namespace, "app=first"), "first's pod gone")
    second = wait_for(lambda: [p for p in pods(cluster, namespace, "app=second")
                               if not gated(p) and p["spec"].get("nodeName")], "second's pod admitted")[0]
    assert admitted(workload_of_pod(cluster, namespace, second))
    cq = wait_for(lambda: (c := get(cluster, "clusterqueue", queue)) and
                  gpu_usage(c)[0] == "1" and c, "the ClusterQueue counting second's 1 GPU")
    assert cq["status"]["pendingWorkloads"] == 0


def test_leader_worker_set_groups_are_admitted_whole(cluster: Cluster, queue: str, namespace: str) -> None:
    """Two groups of two 1-GPU pods against 2 GPUs: one group runs both its pods, the other none."""
    apply(cluster, leader_worker_set("group", replicas=2, gpus_per_pod=1), namespace)
    template = get(cluster, "lws", "group", namespace)["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]
    assert template["labels"][QUEUE_LABEL] == "gpus"
    assert template["annotations"]["kueue.x-k8s.io/pod-group-serving"] == "true"
    selector = "leaderworkerset.sigs.k8s.io/name=group"
    wait_for(lambda: len(pods(cluster, namespace, selector)) == 4, "the LWS controller making both groups' pods",
             timeout=90)

    def by_group() -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for p in pods(cluster, namespace, selector):
            out.setdefault(p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-index"], []).append(p)
        return out

    groups = wait_for(lambda: (g := by_group()) and any(all(not gated(p) for p in ps) for ps in g.values()) and g,
                      "one group admitted")
    state = {i: sorted(gated(p) for p in ps) for i, ps in groups.items()}
    assert sorted(state.values()) == [[False, False], [True, True]], state
    # One Workload per group, owned by the LeaderWorkerSet and by each pod of the group.
    wls = {w["metadata"]["name"]: w for w in workloads(cluster, namespace)}
    assert len(wls) == 2, list(wls)
    for index, ps in groups.items():
        name = ps[0]["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-name"]
        assert name.startswith(f"leaderworkerset-group-{index}-"), name
        wl = wls[name]
        assert {o["kind"] for o in wl["metadata"]["ownerReferences"]} == {"LeaderWorkerSet", "Pod"}
        assert [(s["name"], s["count"]) for s in wl["spec"]["podSets"]] == [("leader", 1), ("worker", 1)]
        assert admitted(wl) == (state[index] == [False, False])
    # Kueue writes the ClusterQueue's flavorsUsage after it admits (seen here: "0 in use" with the group's
    # pods already ungated), so the usage is waited for, not read once.
    wait_for(lambda: gpu_usage(get(cluster, "clusterqueue", queue)) == (str(QUOTA), "0"),
             "the ClusterQueue counting the admitted group's GPUs")


def test_higher_priority_deployment_preempts_within_the_cluster_queue(
        cluster: Cluster, queue: str, namespace: str, priorities: tuple[str, str]) -> None:
    low, high = priorities
    apply(cluster, deployment("batch", gpus=2, priority=low), namespace)
    victim = wait_for(lambda: [p for p in pods(cluster, namespace, "app=batch") if not gated(p)],
                      "the low-priority pod admitted")[0]
    victim_wl = workload_of_pod(cluster, namespace, victim)
    assert victim_wl["spec"]["priority"] == 100 and victim_wl["spec"]["priorityClassRef"]["name"] == low

    apply(cluster, deployment("urgent", gpus=2, priority=high), namespace)
    urgent = wait_for(lambda: [p for p in pods(cluster, namespace, "app=urgent")
                               if not gated(p) and p["spec"].get("nodeName")], "the high-priority pod admitted")[0]
    assert admitted(workload_of_pod(cluster, namespace, urgent))
    # Kueue deletes a preempted Deployment pod, and its Workload goes with it (the pod owns it): the Events on
    # the Workload are what remains. The Deployment makes a replacement, which waits gated.
    replacement = wait_for(lambda: [p for p in pods(cluster, namespace, "app=batch")
                                    if p["metadata"]["uid"] != victim["metadata"]["uid"]],
                           "the preempted pod's replacement")[0]
    assert gated(replacement)
    wait_for(lambda: get(cluster, "workloads.kueue.x-k8s.io", victim_wl["metadata"]["name"], namespace) is None,
             "the preempted Workload gone with its pod")

    def victim_events() -> dict[str, str]:
        return {e["reason"]: e["message"] for e in items(cluster, "events", namespace)
                if e["involvedObject"]["name"] == victim_wl["metadata"]["name"]}

    events = wait_for(lambda: (e := victim_events()) and "Preempted" in e and e, "the Preempted event")
    assert "EvictedDueToPreempted" in events, events
    assert "due to prioritization in the ClusterQueue" in events["Preempted"], events
    assert "preemptee effective priority: 100" in events["Preempted"], events
