"""What the cluster holds for one InferenceService: its children, the workload it follows and its pods
(and its router's, observe/router.py); and what stops the children being written (a name taken, the
LeaderWorkerSet or InferencePool CRD missing, a Secret the pods read missing)."""

from dataclasses import dataclass, field

from tokenmill.operator.children.leaderworkerset import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    as_deployment,
    is_multi_node,
    lws_name,
    not_installed_message,
)
from tokenmill.operator.children.meta import is_owned_by, selector_string
from tokenmill.operator.observe.router import RouterLive, read_router, router_blocker
from tokenmill.operator.observe.secrets import secret_problem
from tokenmill.operator.plan.sizing import SizingPlan
from tokenmill.operator.plan.spec import ServiceSpec


@dataclass(frozen=True, slots=True)
class Live:
    multi_node: bool  # the plan runs as a LeaderWorkerSet (one group of pods per replica)
    objects: dict[str, dict | None]  # the children read, by kind (None: absent)
    foreign: list[str]  # kinds whose object exists under our name but is not ours
    workload_kind: str  # the workload followed: Deployment or LeaderWorkerSet
    workload: dict | None  # that workload in a Deployment's shape; None when absent or not ours
    pods: list[dict]
    router: RouterLive = field(default_factory=RouterLive)  # spec.routing's children, pods and Gateway

    @property
    def current(self) -> int | None:
        """The workload's replicas; None before it exists."""
        return (self.workload or {}).get("spec", {}).get("replicas")


def read_children(api, spec: ServiceSpec, sizing: SizingPlan | None, previous: dict) -> Live:
    """`sizing` None: no plan (the model could not be profiled); `previous`: the status last written."""
    # The workload is a Deployment, or a LeaderWorkerSet of groups when a replica spans nodes. The LWS is
    # read only when planned now or before, so single-node services need no LWS CRD or RBAC.
    multi = sizing is not None and sizing.feasible and is_multi_node(sizing)
    was_multi = int(((previous.get("sizing") or {}).get("nodesPerReplica")) or 1) > 1
    kinds = ("Deployment", "Service", "PodDisruptionBudget", *((KIND,) if multi or was_multi else ()))
    objects = {kind: api.get(kind, spec.namespace, lws_name(spec) if kind == KIND else spec.name) for kind in kinds}
    foreign = [k for k, obj in objects.items() if obj is not None and not is_owned_by(obj, spec)]
    kind = KIND if multi or (was_multi and sizing is not None and not sizing.feasible) else "Deployment"
    workload = as_deployment(kind, objects.get(kind)) if kind not in foreign else None
    pods = api.list("Pod", spec.namespace, selector_string(spec.name))
    return Live(multi, objects, foreign, kind, workload, pods, read_router(api, spec, previous))


def first_blocker(api, spec: ServiceSpec, sizing: SizingPlan, live: Live) -> tuple[str, str] | None:
    """(reason, message) of the first thing that stops a feasible plan's children being written."""
    if live.foreign:
        kinds = ", ".join(f"{k} {spec.name}" for k in live.foreign)
        return "NameConflict", f"{kinds} already exists and is not owned by this InferenceService"
    if live.multi_node and live.workload is None and not api.has_resource(GROUP, VERSION, PLURAL):
        return "LeaderWorkerSetNotInstalled", not_installed_message(sizing)
    routing = router_blocker(api, spec, live.router)
    if routing is not None:
        return routing
    secrets = ((spec.api_key_secret, "spec.apiKeySecretRef"), (spec.token_secret, "spec.model.tokenSecretRef"))
    for ref, where in secrets:
        problem = None if ref is None else secret_problem(api, spec.namespace, *ref, where)
        if problem is not None:
            return "SecretNotFound", problem
    return None
