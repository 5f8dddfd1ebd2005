"""Kueue admission in the operator (plan/kueue.py, observe/kueue.py and their use in reconcile), against the
dict-backed fake API with Kueue objects shaped as the real controller writes them (e2e/test_kueue_controller.py
shows those; e2e/test_kueue_admission.py runs all of this against the real Kueue)."""

import copy

from test_operator_reconcile import NS, FakeApi, add_isvc, cond, deployment_ready, run, smol
from tokenmill.operator.kube import KubeError
from tokenmill.operator.plan.kueue import QueueQuota, queue_cap, queue_quota, workload_name_pattern
from tokenmill.operator.plan.spec import parse_inference_service

GPU = "nvidia.com/gpu"
QUEUE = "kueue.x-k8s.io/queue-name"
PRIORITY = "kueue.x-k8s.io/priority-class"
GATE = {"name": "kueue.x-k8s.io/admission"}
NOW = 1_000_000.0


class KueueApi(FakeApi):
    """FakeApi plus Kueue's objects: a LocalQueue, its ClusterQueue, Workloads and Events."""

    def __init__(self, installed=True):
        super().__init__()
        self.installed = installed
        self.workloads: list[dict] = []
        self.kueue_events: list[dict] = []
        self.forbidden = False
        self.reads: list[str] = []

    def get(self, kind, ns, name):
        if kind in ("LocalQueue", "ClusterQueue"):
            self.reads.append(kind)
            if self.forbidden:
                raise KubeError(403, f"{kind.lower()}s is forbidden")
        return super().get(kind, ns, name)

    def list(self, kind, ns, label_selector=None, field_selector=None):
        if kind == "Workload":
            return copy.deepcopy(self.workloads)
        if kind == "Event":
            assert field_selector == "involvedObject.kind=Workload,reason=Preempted"
            return copy.deepcopy(self.kueue_events)
        return super().list(kind, ns, label_selector)

    def has_resource(self, group, version, plural):
        return self.installed if group == "kueue.x-k8s.io" else True


def cluster_queue(api: KueueApi, nominal=2, used=0, name="team-gpus", cohort=None, borrowing=None):
    resource = {"name": GPU, "nominalQuota": nominal, **({"borrowingLimit": borrowing} if borrowing is not None else {})}
    api.objects[("ClusterQueue", None, name)] = {
        "metadata": {"name": name},
        "spec": {"resourceGroups": [{"coveredResources": ["cpu", "memory", GPU],
                                     "flavors": [{"name": "h100", "resources": [
                                         {"name": "cpu", "nominalQuota": 64}, {"name": "memory", "nominalQuota": "512Gi"},
                                         resource]}]}],
                 **({"cohortName": cohort} if cohort else {})},
        "status": {"flavorsUsage": [{"name": "h100", "resources": [{"name": GPU, "total": str(used)}]}]},
    }
    api.objects[("LocalQueue", NS, "gpus")] = {"metadata": {"name": "gpus", "namespace": NS},
                                               "spec": {"clusterQueue": name}}


def queued_isvc(api, spec, name="chat", queue="gpus", priority=None):
    body = add_isvc(api, spec, name=name)
    body["metadata"]["labels"] = {QUEUE: queue, **({PRIORITY: priority} if priority else {})}
    return body


def pods(api, n, gated=0, gpus=1, name="chat", ready=True):
    """n pods of the Deployment; the last `gated` ones held by Kueue (gated, unscheduled, not ready)."""
    api.pods = []
    for i in range(n):
        held = i >= n - gated
        conditions = ([{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                        "message": "Scheduling is blocked due to non-empty scheduling gates"}] if held
                      else [{"type": "Ready", "status": "True" if ready else "False"}])
        api.pods.append({
            "metadata": {"name": f"{name}-5d8f9c7b4-x{i}abc", "uid": f"pod-uid-{i}"},
            "spec": {"containers": [{"name": "engine", "resources": {"limits": {GPU: str(gpus)}}}],
                     **({"schedulingGates": [GATE]} if held else {})},
            "status": {"phase": "Pending" if held else "Running", "podIP": "" if held else f"10.0.0.{i}",
                       "conditions": conditions},
        })


def pending_workload(api, pod_index: int, message: str):
    pod = api.pods[pod_index]
    api.workloads.append({
        "metadata": {"name": f"pod-{pod['metadata']['name']}-1a2b3", "uid": f"wl-uid-{pod_index}",
                     "ownerReferences": [{"kind": "Pod", "uid": pod["metadata"]["uid"], "controller": True}]},
        "spec": {"queueName": "gpus"},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}]},
    })


# ---------------------------------------------------------------- labels onto the workload

def test_queue_and_priority_labels_go_onto_the_deployment_and_its_pod_template_only():
    api = KueueApi()
    cluster_queue(api)
    queued_isvc(api, smol(replicas=1), priority="inference-high")
    run(api)
    dep = api.objects[("Deployment", NS, "chat")]
    for where in (dep["metadata"]["labels"], dep["spec"]["template"]["metadata"]["labels"]):
        assert where[QUEUE] == "gpus" and where[PRIORITY] == "inference-high", where
    for kind in ("Service", "PodDisruptionBudget"):
        obj = api.objects.get((kind, NS, "chat"))
        assert obj is None or QUEUE not in obj["metadata"]["labels"], kind


def test_no_queue_label_means_no_kueue_reads_and_no_kueue_conditions():
    api = KueueApi()
    add_isvc(api, smol(replicas=1))
    status = run(api)
    assert api.reads == []
    assert QUEUE not in api.objects[("Deployment", NS, "chat")]["metadata"]["labels"]
    assert {c["type"] for c in status["conditions"]}.isdisjoint({"Admitted", "ScalingLimited"})


def test_fields_kueue_webhooks_add_to_the_template_are_not_drift():
    api = KueueApi()
    cluster_queue(api)
    queued_isvc(api, smol(replicas=1))
    run(api)
    dep = api.objects[("Deployment", NS, "chat")]
    # What Kueue's Deployment webhook writes into the template (seen in e2e/test_kueue_controller.py).
    dep["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/managed"] = "true"
    dep["spec"]["template"]["metadata"]["annotations"]["kueue.x-k8s.io/pod-suspending-parent"] = "deployment"
    deployment_ready(api)
    pods(api, 1)
    api.writes.clear()
    run(api)
    assert not [w for w in api.writes if w[0] == "apply" and w[1] == "Deployment"], api.writes


def test_a_queue_change_on_a_running_service_is_refused_and_the_workload_left_as_it_is():
    api = KueueApi()
    cluster_queue(api)
    body = queued_isvc(api, smol(replicas=1))
    run(api)
    deployment_ready(api)
    pods(api, 1)
    run(api)
    body["metadata"]["labels"][QUEUE] = "other"
    body["metadata"]["generation"] = 2
    api.writes.clear()
    status = run(api)
    assert not [w for w in api.writes if w[0] == "apply"], api.writes
    assert api.objects[("Deployment", NS, "chat")]["metadata"]["labels"][QUEUE] == "gpus"
    stalled = cond(status, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "QueueChangeRefused")
    assert "kueue.x-k8s.io/queue-name=other cannot be applied" in stalled["message"]
    assert "runs in LocalQueue gpus with 1 ready replicas" in stalled["message"]
    assert ("Warning", "QueueChangeRefused") in [(e[0], e[1]) for e in api.events]


def test_a_queue_change_is_applied_while_no_replica_is_ready():
    api = KueueApi()
    cluster_queue(api)
    body = queued_isvc(api, smol(replicas=1))
    run(api)
    api.objects[("LocalQueue", NS, "other")] = {"metadata": {"name": "other"}, "spec": {"clusterQueue": "team-gpus"}}
    body["metadata"]["labels"][QUEUE] = "other"
    run(api)
    assert api.objects[("Deployment", NS, "chat")]["metadata"]["labels"][QUEUE] == "other"


def test_a_dropped_queue_label_stays_on_the_workload():
    api = KueueApi()
    cluster_queue(api)
    body = queued_isvc(api, smol(replicas=1))
    run(api)
    del body["metadata"]["labels"][QUEUE]
    body["spec"]["replicas"] = 2
    run(api)
    dep = api.objects[("Deployment", NS, "chat")]
    assert dep["spec"]["replicas"] == 2 and dep["metadata"]["labels"][QUEUE] == "gpus"


# ---------------------------------------------------------------- status while Kueue holds pods

def test_held_pods_make_ready_false_queued_by_kueue_with_the_queue_numbers():
    api = KueueApi()
    cluster_queue(api, nominal=2, used=2)
    queued_isvc(api, smol(replicas=1))
    run(api)
    pods(api, 1, gated=1)
    pending_workload(api, 0, "couldn't assign flavors to pod set main: insufficient unused quota for "
                             "nvidia.com/gpu in flavor h100, 1 more needed")
    # A Deployment long past its progress deadline: waiting in a queue is still not a failure.
    dep = api.objects[("Deployment", NS, "chat")]
    dep["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "chat-5d8f9c7b4" has timed out progressing.'}]}
    status = run(api)
    ready, admitted = cond(status, "Ready"), cond(status, "Admitted")
    assert (ready["status"], ready["reason"]) == ("False", "QueuedByKueue")
    assert (admitted["status"], admitted["reason"]) == ("False", "QueuedByKueue")
    for text in ("LocalQueue gpus -> ClusterQueue team-gpus", "ask for 1 nvidia.com/gpu",
                 "has 0 of 2 nvidia.com/gpu free (2 in use)", "1 more needed"):
        assert text in admitted["message"] and text in ready["message"], (text, admitted["message"])
    assert cond(status, "Stalled")["status"] == "False"  # not PodsBlocked, not ProgressDeadlineExceeded
    assert cond(status, "Reconciling")["reason"] == "QueuedByKueue"
    assert "SchedulingGated" not in ready["message"]


def test_admitted_pods_say_so_and_the_first_admission_after_waiting_is_an_event():
    api = KueueApi()
    cluster_queue(api, nominal=2, used=0)
    queued_isvc(api, smol(replicas=1))
    run(api)
    pods(api, 1, gated=1)
    run(api, now=NOW + 1)
    api.events.clear()
    pods(api, 1)
    cluster_queue(api, nominal=2, used=1)
    deployment_ready(api)
    status = run(api, now=NOW + 2)
    admitted = cond(status, "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("True", "Admitted")
    assert admitted["message"].startswith("1 pods admitted by ClusterQueue team-gpus (1 nvidia.com/gpu)")
    assert cond(status, "Ready")["status"] == "True"
    assert ("Normal", "Admitted") in [(e[0], e[1]) for e in api.events]


def test_a_preempted_replica_says_preempted_and_the_preemptor_names_its_victim():
    api = KueueApi()
    cluster_queue(api, nominal=2, used=2)
    queued_isvc(api, smol(replicas=1), name="batch")
    run(api, name="batch")
    deployment_ready(api, "batch")
    pods(api, 1, name="batch")
    status = run(api, name="batch", now=NOW + 1)
    assert cond(status, "Admitted")["status"] == "True"
    victim = "pod-batch-5d8f9c7b4-x0abc-9f8e7"
    api.kueue_events = [{
        "involvedObject": {"kind": "Workload", "name": victim}, "reason": "Preempted",
        "eventTime": "1970-01-12T13:46:41.123456Z",  # NOW + 1 s
        "message": "Preempted to accommodate a workload (UID: wl-uid-urgent, JobUID: pod-uid-u) due to "
                   "prioritization in the ClusterQueue; preemptor path: /team-gpus; preemptee path: /team-gpus"}]
    pods(api, 1, gated=1, name="batch")  # the Deployment's replacement, gated
    api.objects[("Deployment", NS, "batch")]["status"]["readyReplicas"] = 0
    api.events.clear()
    status = run(api, name="batch", now=NOW + 5)
    admitted = cond(status, "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "Preempted")
    assert "due to prioritization in the ClusterQueue" in admitted["message"]
    assert cond(status, "Ready")["reason"] == "QueuedByKueue"
    assert ("Warning", "Preempted") in [(e[0], e[1]) for e in api.events]

    # The preemptor, another service whose admitted Workload has the UID in the message.
    queued_isvc(api, smol(replicas=1), name="urgent", priority="high")
    run(api, name="urgent")
    deployment_ready(api, "urgent")
    pods(api, 1, name="urgent")
    api.workloads = [{"metadata": {"name": "pod-urgent-6c7d8e9f-x0abc-1a2b3", "uid": "wl-uid-urgent",
                                   "ownerReferences": [{"kind": "Pod", "uid": "pod-uid-0"}]},
                      "status": {"conditions": [{"type": "Admitted", "status": "True"}]}}]
    status = run(api, name="urgent", now=NOW + 6)
    assert cond(status, "Admitted")["message"].endswith(f"admitted by preempting {victim}")


def test_a_preemption_older_than_the_event_ttl_is_not_the_reason_any_more():
    api = KueueApi()
    cluster_queue(api, nominal=2, used=2)
    queued_isvc(api, smol(replicas=1), name="batch")
    run(api, name="batch")
    pods(api, 1, gated=1, name="batch")
    api.kueue_events = [{"involvedObject": {"kind": "Workload", "name": "pod-batch-5d8f9c7b4-x0abc-9f8e7"},
                         "reason": "Preempted", "lastTimestamp": "1970-01-12T12:00:00Z", "message": "old"}]
    status = run(api, name="batch", now=NOW + 5)
    assert cond(status, "Admitted")["reason"] == "QueuedByKueue"


def test_missing_local_queue_kueue_not_installed_and_forbidden_reads_are_named():
    api = KueueApi()
    queued_isvc(api, smol(replicas=1), queue="nope")
    run(api)
    pods(api, 1, gated=1)
    a = cond(run(api), "Admitted")
    assert (a["status"], a["reason"]) == ("False", "LocalQueueNotFound")
    assert f"LocalQueue nope does not exist in namespace {NS}" in a["message"]

    api = KueueApi(installed=False)
    queued_isvc(api, smol(replicas=1))
    a = cond(run(api), "Admitted")
    assert (a["status"], a["reason"]) == ("Unknown", "KueueNotInstalled")
    assert "does not serve kueue.x-k8s.io/v1beta2" in a["message"]

    api = KueueApi()
    api.forbidden = True
    queued_isvc(api, smol(replicas=1))
    a = cond(run(api), "Admitted")
    assert (a["status"], a["reason"]) == ("Unknown", "KueueUnreadable")
    assert "403" in a["message"] and "rbac.kueue" in a["message"]


# ---------------------------------------------------------------- the autoscaler and the ClusterQueue

def test_cluster_queue_numbers_from_its_spec_and_status():
    api = KueueApi()
    cluster_queue(api, nominal=4, used=3, cohort="org", borrowing=2)
    q = queue_quota(api.objects[("ClusterQueue", None, "team-gpus")])
    assert (q.covered, q.nominal, q.used, q.free, q.borrowing_limit, q.cohort) == (True, 4, 3, 1, 2, "org")
    assert queue_quota({"metadata": {"name": "c"}, "spec": {"resourceGroups": [
        {"coveredResources": ["cpu"], "flavors": [{"name": "f", "resources": [{"name": "cpu", "nominalQuota": 8}]}]}]}}
    ).covered is False


def test_queue_cap_is_nominal_plus_borrowing_less_what_others_hold():
    # 4 nominal + 2 borrowable; 5 in use of which 2 are this service's: 6 - 3 = 3 GPUs, 1 replica of 2 GPUs.
    cap = queue_cap(QueueQuota("q", True, 4, 2, "org", 5), own_gpus=2, gpus_per_replica=2)
    assert cap.max_replicas == 1
    assert "nominal 4 + borrowing limit 2, 3 used by other workloads" in cap.message
    assert queue_cap(QueueQuota("q", True, 4, None, "org", 0), 0, 1).max_replicas is None


def _autoscaled(api, used, own_pods, queue_depth_per_pod=50.0):
    from tokenmill.operator.plan.observations import PodReading

    cluster_queue(api, nominal=2, used=used)
    queued_isvc(api, smol(scaling={"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 10}))
    run(api)
    pods(api, own_pods)
    dep = api.objects[("Deployment", NS, "chat")]
    dep["spec"]["replicas"] = own_pods
    deployment_ready(api)
    return lambda pods_, timeout: {p["metadata"]["name"]: PodReading(waiting=queue_depth_per_pod) for p in pods_}


def test_autoscaler_stops_at_what_the_cluster_queue_admits():
    api = KueueApi()
    scrape = _autoscaled(api, used=1, own_pods=1)
    status = run(api, autoscale=True, now=NOW + 30, scrape=scrape)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2  # wants 4 (depth 50 / 10), queue has 2
    limited = cond(status, "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "QueueQuota")
    assert "the autoscaler wants 4 replicas; ClusterQueue team-gpus admits 2 replicas x 1 nvidia.com/gpu" in limited["message"]
    assert "held at 2 (the ClusterQueue bound holds)" in limited["message"]
    assert cond(status, "QuotaLimited")["reason"] == "NoGPUQuota"  # ResourceQuota's condition unchanged


def test_after_preemption_the_autoscaler_does_not_ask_again_nor_drop_the_held_replica():
    # 2 replicas, one preempted (its replacement gated) while another workload holds 1 of the 2 GPUs.
    api = KueueApi()
    scrape = _autoscaled(api, used=2, own_pods=2)
    pods(api, 2, gated=1)
    for _ in range(3):
        status = run(api, autoscale=True, now=NOW + 30, scrape=scrape)
        assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2
    assert "admits 1 replicas" in cond(status, "ScalingLimited")["message"]


def test_with_a_resource_quota_too_the_message_says_which_bound_holds():
    api = KueueApi()
    scrape = _autoscaled(api, used=1, own_pods=1)
    api.objects[("ClusterQueue", None, "team-gpus")]["spec"]["resourceGroups"][0]["flavors"][0]["resources"][2][
        "nominalQuota"] = 8
    api.quotas = [{"metadata": {"name": "gpu-quota"}, "spec": {"hard": {f"requests.{GPU}": "3"}},
                   "status": {"hard": {f"requests.{GPU}": "3"}, "used": {f"requests.{GPU}": "1"}}}]
    status = run(api, autoscale=True, now=NOW + 30, scrape=scrape)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 3
    limited = cond(status, "ScalingLimited")
    assert limited["status"] == "True" and "(the ResourceQuota bound holds)" in limited["message"]
    assert "ResourceQuota gpu-quota" in limited["message"] and "ClusterQueue team-gpus admits 8" in limited["message"]
    assert cond(status, "QuotaLimited")["status"] == "True"


def test_workload_names_of_other_services_do_not_match():
    spec = parse_inference_service({"metadata": {"name": "batch", "namespace": NS}, "spec": smol(replicas=1)})
    pattern = workload_name_pattern(spec, "batch-lws")
    assert pattern.match("pod-batch-5d8f9c7b4-x0abc-9f8e7")
    assert pattern.match("leaderworkerset-batch-lws-1-9f8e7")
    assert not pattern.match("pod-batch-two-5d8f9c7b4-x0abc-9f8e7")
    assert not pattern.match("pod-batchx-5d8f9c7b4-x0abc-9f8e7")


def test_a_leader_worker_set_group_is_held_or_admitted_whole():
    from tokenmill.operator.plan.kueue import QueueView, admission

    spec = parse_inference_service({"metadata": {"name": "big", "namespace": NS, "labels": {QUEUE: "gpus"}},
                                    "spec": smol(replicas=2)})
    api = KueueApi()
    cluster_queue(api, nominal=2, used=2)

    def pod(group: int, worker: int) -> dict:
        return {"metadata": {"name": f"big-lws-{group}" + (f"-{worker}" if worker else ""),
                             "labels": {"leaderworkerset.sigs.k8s.io/group-index": str(group)}},
                "spec": {"schedulingGates": [GATE]} if group == 1 else {}}

    view = QueueView("gpus", local_queue=api.objects[("LocalQueue", NS, "gpus")],
                     cluster_queue=api.objects[("ClusterQueue", None, "team-gpus")])
    result = admission(spec, view, [pod(g, w) for g in (0, 1) for w in (0, 1)], 2,
                       workload_name_pattern(spec, "big-lws"), NOW)
    assert (result.queued, result.admitted_replicas, result.own_gpus) == (1, 1, 2)
    assert "Kueue holds 1 of 2 groups" in result.admitted.message
    assert "ask for 2 nvidia.com/gpu (2 per replica)" in result.admitted.message


def test_scaling_limited_stands_between_autoscaling_passes():
    api = KueueApi()
    scrape = _autoscaled(api, used=1, own_pods=1)
    assert cond(run(api, autoscale=True, now=NOW + 30, scrape=scrape), "ScalingLimited")["status"] == "True"
    api.events.clear()
    status = run(api, autoscale=False, now=NOW + 31)  # a watch event's reconcile: no autoscaling decision
    assert cond(status, "ScalingLimited")["status"] == "True"
    assert not [e for e in api.events if e[1] in ("WithinQueueQuota", "QueueQuota")], api.events


def test_a_cluster_queue_usage_behind_this_services_admitted_pods_counts_them():
    api = KueueApi()
    cluster_queue(api, nominal=2, used=0)  # flavorsUsage not yet updated by Kueue
    queued_isvc(api, smol(replicas=2))
    run(api)
    pods(api, 2)
    deployment_ready(api)
    message = cond(run(api), "Admitted")["message"]
    assert "has 0 of 2 nvidia.com/gpu free (2 in use)" in message, message
