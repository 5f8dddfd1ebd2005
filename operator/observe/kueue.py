"""What Kueue says about one queued InferenceService: its LocalQueue, that queue's ClusterQueue, the
Workloads Kueue made for its pods (or LeaderWorkerSet groups) and the namespace's Preempted Events.
Read only for a service with the `kueue.x-k8s.io/queue-name` label; a service without one costs no request.
plan/kueue.py decides from these."""

from tokenmill.operator.kube import KubeError
from tokenmill.operator.observe.cluster import Live
from tokenmill.operator.plan.kueue import API_GROUP, API_VERSION, QueueView

PREEMPTED_EVENTS = "involvedObject.kind=Workload,reason=Preempted"


def read_queue(api, namespace: str, queue: str | None, live: Live) -> QueueView | None:
    if not queue:
        return None
    try:
        local = api.get("LocalQueue", namespace, queue)
        if local is None and not api.has_resource(API_GROUP, API_VERSION, "localqueues"):
            return QueueView(queue, installed=False)
        cq_name = ((local or {}).get("spec") or {}).get("clusterQueue")
        cq = api.get("ClusterQueue", None, cq_name) if cq_name else None
        owners = {p["metadata"].get("uid") for p in live.pods}
        owners |= {(o.get("metadata") or {}).get("uid") for o in live.objects.values() if o is not None}
        owners.discard(None)
        workloads = [w for w in api.list("Workload", namespace)
                     if any(r.get("uid") in owners for r in (w.get("metadata") or {}).get("ownerReferences") or [])]
        events = api.list("Event", namespace, field_selector=PREEMPTED_EVENTS)
    except KubeError as e:
        return QueueView(queue, error=str(e))
    return QueueView(queue, local_queue=local, cluster_queue=cq, workloads=workloads, events=events)
