"""One reconcile of one InferenceService: read, decide with pure functions, apply, write status.

`api` is a KubeApi or anything with the same methods (tests use a dict-backed fake). Kopf never
appears here; handlers.py calls `reconcile` from watch events and from the per-object timer loop.
The decisions live elsewhere: the profile (profiles.py), the plan (sizing.py), the replica count
(replicas.py), the children (children.py), the conditions (conditions.py).
"""

import logging
import threading
import time
from dataclasses import dataclass, field

from tokenmill.operator.apply import differs
from tokenmill.operator.children import leaderworkerset as lws
from tokenmill.operator.children import model_source
from tokenmill.operator.children.cache_pvc import desired_cache_claim
from tokenmill.operator.children.deployment import desired_deployment
from tokenmill.operator.children.meta import is_owned_by, selector_string
from tokenmill.operator.children.pdb import desired_pdb
from tokenmill.operator.children.pod import DEFAULT_ENGINE_IMAGE
from tokenmill.operator.children.service import desired_service, endpoint
from tokenmill.operator.kube import KubeError, merge_patch
from tokenmill.operator.observe import engine_metrics as metrics
from tokenmill.operator.observe.hub import HubCache, HubError, parse_hf_uri
from tokenmill.operator.observe.secrets import secret_problem
from tokenmill.operator.plan import autoscaler
from tokenmill.operator.plan import replicas as rep
from tokenmill.operator.plan.catalog import GPU_TYPES, ProfileError
from tokenmill.operator.plan.conditions import (
    Condition,
    Facts,
    compute_conditions,
    merge_conditions,
    rollout_from,
    transition_events,
)
from tokenmill.operator.plan.profiles import hub_status, resolve_with_hub
from tokenmill.operator.plan.quota import cap_replicas
from tokenmill.operator.plan.sizing import gpus_per_replica, plan
from tokenmill.operator.plan.spec import SpecError, parse_inference_service
from tokenmill.operator.status import capacity_event, iso, keep_measured, plan_status

log = logging.getLogger("tokenmill.operator")


@dataclass(slots=True)
class OperatorConfig:
    engine_image: str = DEFAULT_ENGINE_IMAGE
    interval: float = 15.0  # seconds between autoscaling / drift passes per object
    metrics_timeout: float = 2.0
    stale_after: float = autoscaler.STALE_AFTER_SECONDS
    hf_endpoint: str | None = None  # HF_ENDPOINT for the engine pods and the operator's hub lookups
    hub: HubCache = field(default_factory=HubCache)


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def service_lock(namespace: str, name: str) -> threading.Lock:
    """Watch events and the timer loop may reconcile the same object at once; one at a time."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def forget(namespace: str, name: str) -> None:
    with _locks_guard:
        _locks.pop((namespace, name), None)


def reconcile(
    api,
    body: dict,
    config: OperatorConfig,
    autoscale: bool,
    now: float | None = None,
    scrape=metrics.scrape_pods,
    query_prometheus=metrics.query_prometheus,
) -> dict:
    """Bring one InferenceService's children and status in line; returns the status written."""
    meta = body.get("metadata") or {}
    ns, name = meta.get("namespace", ""), meta.get("name", "")
    with service_lock(ns, name):
        # Re-read under the lock: a reconcile that waited must see the status the previous one wrote,
        # or it would repeat its events and undo its status.
        fresh = api.get("InferenceService", ns, name)
        if fresh is None or (fresh.get("metadata") or {}).get("uid") != meta.get("uid"):
            return {}  # deleted, or replaced by a new object that has its own reconciles
        return _reconcile(api, fresh, config, autoscale, time.time() if now is None else now, scrape, query_prometheus)


def _reconcile(api, body, config, autoscale, now, scrape, query_prometheus) -> dict:
    meta = body.get("metadata") or {}
    ns, name, generation = meta.get("namespace"), meta.get("name"), int(meta.get("generation") or 0)
    previous = {k: v for k, v in (body.get("status") or {}).items() if k != "kopf"}
    status: dict = {"observedGeneration": generation, "selector": selector_string(name)}
    events: list[tuple[str, str, str]] = []

    def finish(facts: Facts) -> dict:
        conditions = compute_conditions(facts)
        status["conditions"] = merge_conditions(previous.get("conditions"), conditions, generation, iso(now))
        events.extend(transition_events(previous.get("conditions"), conditions))
        patch = merge_patch(previous, status)
        if patch:
            api.patch_status(ns, name, patch)
        for type_, reason, message in events:
            log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s/%s %s: %s", ns, name, reason, message)
            try:
                api.create_event(body, type_, reason, message)
            except KubeError as e:  # events are best effort; the status already says it
                log.warning("event for %s/%s not posted: %s", ns, name, e)
        return status

    try:
        spec = parse_inference_service(body)
    except SpecError as e:
        return finish(Facts(spec_error=str(e)))
    status["endpoint"] = endpoint(spec)

    profile, sizing = None, None
    try:
        profile, hub_model = resolve_with_hub(spec, _hub_lookup(api, spec, config))
        sizing = plan(profile, GPU_TYPES[spec.gpu_type], spec.engine, spec.gpu_count)
        status["sizing"] = plan_status(sizing, profile)
        if hub_model is not None:
            status["sizing"]["hub"] = hub_status(hub_model, profile)
        sized = Condition("Sized", "True" if sizing.feasible else "False", sizing.reason, sizing.message)
    except ProfileError as e:
        status["sizing"] = {"feasible": False, "reason": e.reason, "message": str(e), "gpuType": spec.gpu_type}
        # An unreachable Hub says nothing about the model: whether it fits is unknown, not no.
        sized = Condition("Sized", "Unknown" if e.reason == "HubUnreachable" else "False", e.reason, str(e))

    # The workload is a Deployment, or a LeaderWorkerSet of groups when a replica spans nodes (lws.py).
    # The LWS is read only when planned now or before, so single-node services need no LWS CRD or RBAC.
    multi = sizing is not None and sizing.feasible and lws.is_multi_node(sizing)
    was_multi = int(((previous.get("sizing") or {}).get("nodesPerReplica")) or 1) > 1
    kinds = ("Deployment", "Service", "PodDisruptionBudget", *((lws.KIND,) if multi or was_multi else ()))
    live = {kind: api.get(kind, ns, lws.lws_name(spec) if kind == lws.KIND else name) for kind in kinds}
    foreign = [k for k, obj in live.items() if obj is not None and not is_owned_by(obj, spec)]
    workload_kind = lws.KIND if multi or (was_multi and sizing is not None and not sizing.feasible) else "Deployment"
    view = lws.rollout_source if workload_kind == lws.KIND else (lambda obj: obj)
    deployment = view(live.get(workload_kind)) if workload_kind not in foreign else None
    current = (deployment or {}).get("spec", {}).get("replicas")
    pods = api.list("Pod", ns, selector_string(name))
    if workload_kind == lws.KIND:
        status["selector"] = f"{status['selector']},{lws.ROLE_LABEL}={lws.LEADER}"

    def stuck(blocker: tuple[str, str] | None) -> dict:
        # Infeasible or blocked: create nothing, and leave a running Deployment as it is (a bad edit
        # must not take down a service that works); status says why.
        keep = current if current is not None else 0
        status["desiredReplicas"] = keep
        status["replicas"] = int(((deployment or {}).get("status") or {}).get("replicas") or 0)
        status["readyReplicas"] = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
        keep_measured(previous, status, generation)
        return finish(Facts(sized=sized, blocker=blocker, rollout=rollout_from(deployment, keep, pods),
                            endpoint=status["endpoint"]))

    if sizing is None or not sizing.feasible:
        return stuck(None)
    if foreign:
        kinds = ", ".join(f"{k} {name}" for k in foreign)
        return stuck(("NameConflict", f"{kinds} already exists and is not owned by this InferenceService"))
    if multi and deployment is None and not api.has_resource(lws.GROUP, lws.VERSION, lws.PLURAL):
        return stuck(("LeaderWorkerSetNotInstalled", lws.not_installed_message(sizing)))
    for ref, where in ((spec.api_key_secret, "spec.apiKeySecretRef"), (spec.token_secret, "spec.model.tokenSecretRef")):
        problem = None if ref is None else secret_problem(api, ns, *ref, where)
        if problem is not None:
            return stuck(("SecretNotFound", problem))

    # --- replicas: fixed, or the autoscaler's decision; then the GPU quota cap ---
    ready = [p for p in lws.serving_pods(pods) if rep.is_ready(p)]  # group workers serve no metrics
    readings, metrics_error = {}, None
    if autoscale and ready:
        readings, metrics_error = rep.read_metrics(spec, ready, config, scrape, query_prometheus)
    measured = metrics.measured_capacity(readings)
    if measured:
        status["sizing"]["measured"] = {**measured, "time": iso(now)}
        if not (previous.get("sizing") or {}).get("measured"):
            events.append(capacity_event(sizing, measured))
    else:
        keep_measured(previous, status, generation)
    measured = status["sizing"].get("measured")

    wanted, scaling_cond, decision = rep.decide_replicas(spec, sizing, current, ready, readings, metrics_error,
                                                         previous, measured, config, autoscale, now)
    cap = cap_replicas(wanted, gpus_per_replica(sizing), api.list("ResourceQuota", ns), pods,
                       spec.template.get("priorityClassName"))
    replicas = wanted if cap.max_replicas is None else min(wanted, cap.max_replicas)
    quota_cond = rep.quota_condition(cap)

    # --- children ---
    _apply_cache_claim(api, spec, events)
    if multi:
        desired = lws.desired_leaderworkerset(spec, sizing, replicas, config.engine_image, config.hf_endpoint)
        engine = desired["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        shape = f"groups of {sizing.nodes_per_replica} pods x {sizing.tensor_parallel_size}"
    else:
        desired = desired_deployment(spec, sizing, replicas, config.engine_image, config.hf_endpoint)
        engine = desired["spec"]["template"]["spec"]["containers"][0]
        shape = f"replicas x {gpus_per_replica(sizing)}"
    workload = f"{workload_kind} {desired['metadata']['name']}"
    spec_changed = deployment is None or differs(
        {**desired["spec"], "replicas": None}, {**deployment.get("spec", {}), "replicas": None})
    if deployment is None:
        deployment = view(api.apply(desired))
        events.append(("Normal", "Created", f"{workload}: {replicas} {shape} {spec.gpu_type}, {' '.join(engine['args'])}"))
    elif differs(desired, deployment):
        if current is not None and current != replicas:
            why = decision.message if decision is not None and decision.replicas == wanted else scaling_cond.message
            if cap.limited:
                why = cap.message
            events.append(("Normal", "ScaledUp" if replicas > current else "ScaledDown",
                           f"{workload} from {current} to {replicas} replicas: {why}"))
            status.setdefault("scaling", {})["lastScaleTime"] = iso(now)
        deployment = view(api.apply(desired))
    # A plan that moved between one node and several: the other workload kind goes once the new one exists.
    other = "Deployment" if multi else lws.KIND
    if live.get(other) is not None and other not in foreign:
        api.delete(other, ns, live[other]["metadata"]["name"])
        events.append(("Normal", "Deleted", f"{other} {live[other]['metadata']['name']}: replaced by {workload}"))
    service = desired_service(spec, lws.leader_only() if multi else None)
    for kind, want in (("Service", service), ("PodDisruptionBudget", desired_pdb(spec))):
        if want is None:
            if live[kind] is not None:
                api.delete(kind, ns, name)
        elif live[kind] is None or differs(want, live[kind]):
            api.apply(want)
            if live[kind] is None:
                events.append(("Normal", "Created", f"{kind} {name}"))

    scaling_status = rep.scaling_status(spec, sizing, previous, status, decision, measured)
    if scaling_status is not None:
        status["scaling"] = scaling_status
    else:
        status.pop("scaling", None)

    dstatus = deployment.get("status") or {}
    status["desiredReplicas"] = replicas
    status["replicas"] = int(dstatus.get("replicas") or 0)
    status["readyReplicas"] = int(dstatus.get("readyReplicas") or 0)
    floor = spec.scaling.min_replicas if spec.scaling is not None else None
    rollout = rollout_from(deployment, replicas, pods, floor, spec_changed)
    return finish(Facts(sized=sized, rollout=rollout, quota=quota_cond,
                        scaling=scaling_cond, endpoint=status["endpoint"]))


def _hub_lookup(api, spec, config: OperatorConfig):
    """lookup(with_config) for an hf:// model: the Hub asked with the token of spec.model.tokenSecretRef."""
    if spec.model_scheme != "hf":
        return None
    repo, revision = parse_hf_uri(spec.model_uri)

    def lookup(with_config: bool):
        token, unreadable = None, False
        if spec.token_secret is not None:
            try:
                token = api.secret_value(spec.namespace, *spec.token_secret)
            except KubeError as e:
                if e.status != 403:
                    raise
                unreadable = True  # not allowed to read Secrets here: ask without the token
            else:
                if token is None:  # say that, not "gated" (which the Hub would answer without a token)
                    raise HubError("SecretNotFound", secret_problem(api, spec.namespace, *spec.token_secret,
                                                                    "spec.model.tokenSecretRef") or "")
        try:
            return config.hub.lookup(repo, revision, token, config.hf_endpoint, with_config)
        except HubError as e:
            if e.reason != "GatedModel" or not unreadable:
                raise
            if not with_config:
                return None  # the pods get the token; the catalog sizes the model
            name = spec.token_secret[0]
            raise HubError("GatedModel", f"{e}; the operator may not read Secret {name} to fetch config.json: "
                                         f"add {name} to the chart value rbac.secretNames (default [hf-token]), "
                                         "or set spec.model.profile") from None

    return lookup


def _apply_cache_claim(api, spec, events: list) -> None:
    """The model cache PVC the operator creates from spec.model.cache.size (deleted again when the spec
    names a claim or drops the cache). A claim's class and access mode cannot change once created: such
    an edit is logged and left alone; only a larger size is applied (volume expansion)."""
    if spec.model_scheme != "hf":
        return
    name = f"{spec.name}{model_source.CACHE_CLAIM_SUFFIX}"
    want = desired_cache_claim(spec)
    live = api.get("PersistentVolumeClaim", spec.namespace, name)
    if want is None:
        if live is not None and is_owned_by(live, spec):
            api.delete("PersistentVolumeClaim", spec.namespace, name)
        return
    if live is None:
        api.apply(want)
        events.append(("Normal", "Created", f"PersistentVolumeClaim {name} ({spec.cache.size}) for the model cache"))
    elif is_owned_by(live, spec) and differs(want, live):
        fixed = {k: v for k, v in want["spec"].items() if k != "resources"}
        if differs(fixed, live.get("spec") or {}):
            log.warning("%s/%s: PersistentVolumeClaim %s keeps its storage class and access mode (immutable); "
                        "delete it to recreate it", spec.namespace, spec.name, name)
        else:
            api.apply(want)
