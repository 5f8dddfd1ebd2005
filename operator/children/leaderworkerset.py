"""The LeaderWorkerSet of a multi-node InferenceService: one group of pods per replica.

A plan with nodes_per_replica > 1 runs each replica as a LeaderWorkerSet group (`leaderworkerset.x-k8s.io/v1`,
controller sigs.k8s.io/lws): a leader pod that serves HTTP and `size - 1` worker pods, one per node, that
join the leader's torch.distributed group. The LWS controller's pod webhook gives every container
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX; the engine rendezvous from them. Pure functions:
spec and plan in, dicts out.
"""

from tokenmill.operator.children.meta import stamp, workload_metadata
from tokenmill.operator.children.pod import pod_template
from tokenmill.operator.plan.sizing import SizingPlan
from tokenmill.operator.plan.spec import ServiceSpec

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LeaderWorkerSet"
# Which pod of a group this is: only leaders serve HTTP, so only they back the Service and are scraped.
ROLE_LABEL = "serving.tokenmill.dev/role"
LEADER, WORKER = "leader", "worker"
# Set by the LWS controller on every pod of a group ("0" on the leader).
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
# The worker's engine mode: no HTTP server, it runs its ranks' share of each step the leader broadcasts.
HEADLESS_FLAG = "--headless"


def is_multi_node(plan: SizingPlan) -> bool:
    return plan.nodes_per_replica > 1


def not_installed_message(plan: SizingPlan) -> str:
    return (
        f"the plan needs {plan.nodes_per_replica} nodes per replica (TP {plan.tensor_parallel_size} x PP "
        f"{plan.pipeline_parallel_size} on {plan.gpu_type}), which runs as a LeaderWorkerSet, but the API server "
        f"does not serve {PLURAL}.{GROUP}/{VERSION}: install the LeaderWorkerSet controller (sigs.k8s.io/lws), "
        "or choose a GPU type or dtype that fits one node"
    )


def lws_name(spec: ServiceSpec) -> str:
    """Not the InferenceService's name: the LWS controller creates a headless Service named after the
    LWS (the pods' DNS subdomain, how workers find LWS_LEADER_ADDRESS), and `spec.name` is our ClusterIP
    Service. With the same name the controller would adopt ours and leader addresses would not resolve."""
    return f"{spec.name}-lws"


def leader_only() -> dict[str, str]:
    return {ROLE_LABEL: LEADER}


def _with_role(template: dict, role: str) -> dict:
    meta = template["metadata"]
    return {**template, "metadata": {**meta, "labels": {**meta["labels"], ROLE_LABEL: role}}}


def worker_template(leader: dict) -> dict:
    """The leader's pod with the engine in headless mode: same image, model, volumes and GPUs, no HTTP
    port, no HTTP probes (nothing listens), no metrics annotations. A dead worker restarts the group."""
    spec = dict(leader["spec"])
    containers = []
    for c in spec["containers"]:
        c = {k: v for k, v in c.items() if k not in ("ports", "startupProbe", "readinessProbe", "livenessProbe")}
        if c["name"] == "engine":
            c["args"] = [*c["args"], HEADLESS_FLAG]
        containers.append(c)
    spec["containers"] = containers
    meta = leader["metadata"]
    annotations = {k: v for k, v in meta["annotations"].items() if not k.startswith("prometheus.io/")}
    return _with_role({"metadata": {**meta, "annotations": annotations}, "spec": spec}, WORKER)


def desired_leaderworkerset(spec: ServiceSpec, plan: SizingPlan, replicas: int, image: str,
                            hf_endpoint: str | None = None) -> dict:
    """`replicas` groups of `plan.nodes_per_replica` pods (LWS's spec.replicas counts groups)."""
    leader = _with_role(pod_template(spec, plan, image, hf_endpoint), LEADER)
    metadata = {**workload_metadata(spec), "name": lws_name(spec)}
    return stamp({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            # Workers start with the leader, not after it is Ready: the leader's engine is only ready
            # once every rank has joined.
            "startupPolicy": "LeaderCreated",
            # As for Deployments: no surge (a whole group of GPU nodes may not be free), one group at a time.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": plan.nodes_per_replica,
                # One rank lost stalls every collective of the group: restart the group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker_template(leader),
            },
        },
    })


def rollout_source(lws: dict | None) -> dict | None:
    """The LWS in the shape conditions.rollout_from reads from a Deployment. Its status counts groups:
    readyReplicas are groups whose every pod is ready. LWS has no status.observedGeneration; while its
    UpdateInProgress condition is True the rollout of the latest template is not done."""
    if lws is None:
        return None
    status = lws.get("status") or {}
    generation = int((lws.get("metadata") or {}).get("generation") or 0)
    updating = any(c.get("type") == "UpdateInProgress" and c.get("status") == "True"
                   for c in status.get("conditions") or [])
    return {
        "metadata": lws.get("metadata") or {},
        "spec": lws.get("spec") or {},
        "status": {
            "replicas": int(status.get("replicas") or 0),
            "readyReplicas": int(status.get("readyReplicas") or 0),
            "updatedReplicas": int(status.get("updatedReplicas") or 0),
            "observedGeneration": generation - 1 if updating else generation,
        },
    }


def as_deployment(kind: str, workload: dict | None) -> dict | None:
    """A workload of either kind in the shape conditions.rollout_from reads (a Deployment's)."""
    return rollout_source(workload) if kind == KIND else workload


def serving_pods(pods: list[dict]) -> list[dict]:
    """Pods that serve HTTP (and metrics): Deployment pods and group leaders, not workers."""
    return [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) != WORKER]
