"""One reconcile of one InferenceService: read, decide with pure functions, apply, write status.

`api` is a KubeApi or anything with the same methods (tests use a dict-backed fake). Kopf never
appears here; handlers.py calls `reconcile` from watch events and from the per-object timer loop.
"""

import datetime
import logging
import threading
import time
from dataclasses import dataclass

from tokenmill.operator import autoscaler, children, metrics
from tokenmill.operator.catalog import (
    GPU_TYPES,
    ModelProfile,
    ProfileError,
    find_model_profile,
    profile_from_spec,
)
from tokenmill.operator.conditions import (
    Condition,
    Facts,
    compute_conditions,
    merge_conditions,
    rollout_from,
    transition_events,
)
from tokenmill.operator.kube import KubeError, merge_patch
from tokenmill.operator.quota import cap_replicas
from tokenmill.operator.sizing import REFERENCE_SEQUENCE_TOKENS, SizingPlan, gpus_per_replica, plan
from tokenmill.operator.spec import ServiceSpec, SpecError, parse_inference_service

log = logging.getLogger("tokenmill.operator")


@dataclass(slots=True)
class OperatorConfig:
    engine_image: str = children.DEFAULT_ENGINE_IMAGE
    interval: float = 15.0  # seconds between autoscaling / drift passes per object
    metrics_timeout: float = 2.0
    stale_after: float = autoscaler.STALE_AFTER_SECONDS


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def service_lock(namespace: str, name: str) -> threading.Lock:
    """Watch events and the timer loop may reconcile the same object at once; one at a time."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def forget(namespace: str, name: str) -> None:
    with _locks_guard:
        _locks.pop((namespace, name), None)


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def resolve_profile(spec: ServiceSpec) -> ModelProfile:
    """Catalog entry named by profile.base or matched by the uri, overridden by spec.model.profile."""
    given = dict(spec.profile or {})
    base_name = given.pop("base", None)
    base = find_model_profile(base_name or spec.model_uri)
    if base_name and base is None:
        raise ProfileError("UnknownModelProfile", f"profile.base {base_name!r} is not in the catalog")
    return profile_from_spec(given, base, spec.served_model_name)


def plan_status(p: SizingPlan, profile: ModelProfile | None) -> dict:
    return {
        "model": p.model,
        "profileSource": profile.source if profile else "",
        "feasible": p.feasible,
        "reason": p.reason,
        "message": p.message,
        "gpuType": p.gpu_type,
        "gpusPerReplica": gpus_per_replica(p),
        "dtype": p.dtype,
        "gpuMemoryBytes": p.gpu_memory_bytes,
        "weightsBytes": p.weights_bytes,
        "weightsBytesPerGPU": p.weights_bytes_per_gpu,
        "overheadBytes": p.overhead_bytes,
        "kvCacheBytes": p.kv_cache_bytes,
        "kvBytesPerToken": p.kv_bytes_per_token,
        "blockSize": p.block_size,
        "kvBlocks": p.kv_blocks,
        "kvTokens": p.kv_tokens,
        "maxModelLen": p.max_model_len,
        "maxNumSeqs": p.max_num_seqs,
        "targetQueueDepth": p.target_queue_depth,
    }


def capacity_target(p: SizingPlan, measured: dict | None) -> int:
    """Requests one replica serves without queueing: the planned target, or the same rule applied to
    the KV tokens the engines report once they run (the closed loop)."""
    tokens = (measured or {}).get("kvTokens")
    if not tokens:
        return p.target_queue_depth
    per_seq = -(-min(p.max_model_len, REFERENCE_SEQUENCE_TOKENS) // p.block_size)
    return max(1, min(p.max_num_seqs, (int(tokens) // p.block_size) // per_seq))


def is_ready(pod: dict) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


def _history(previous: dict) -> tuple[autoscaler.Recommendation, ...]:
    out = []
    for item in ((previous.get("scaling") or {}).get("recommendations")) or []:
        try:
            out.append(autoscaler.Recommendation(from_iso(item["time"]), int(item["replicas"])))
        except (KeyError, ValueError, TypeError):
            continue  # a hand-edited status: drop the entry rather than fail
    return tuple(sorted(out, key=lambda r: r.time))


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
    status: dict = {"observedGeneration": generation, "selector": children.selector_string(name)}
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
    status["endpoint"] = children.endpoint(spec)

    profile, sizing = None, None
    try:
        profile = resolve_profile(spec)
        sizing = plan(profile, GPU_TYPES[spec.gpu_type], spec.engine, spec.gpu_count)
        status["sizing"] = plan_status(sizing, profile)
        sized = Condition("Sized", "True" if sizing.feasible else "False", sizing.reason, sizing.message)
    except ProfileError as e:
        status["sizing"] = {"feasible": False, "reason": e.reason, "message": str(e), "gpuType": spec.gpu_type}
        sized = Condition("Sized", "False", e.reason, str(e))

    live = {kind: api.get(kind, ns, name) for kind in ("Deployment", "Service", "PodDisruptionBudget")}
    foreign = [k for k, obj in live.items() if obj is not None and not children.is_owned_by(obj, spec)]
    deployment = live["Deployment"] if "Deployment" not in foreign else None
    current = (deployment or {}).get("spec", {}).get("replicas")
    pods = api.list("Pod", ns, children.selector_string(name))

    def stuck(blocker: tuple[str, str] | None) -> dict:
        # Infeasible or blocked: create nothing, and leave a running Deployment as it is (a bad edit
        # must not take down a service that works); status says why.
        keep = current if current is not None else 0
        status["desiredReplicas"] = keep
        status["replicas"] = int(((deployment or {}).get("status") or {}).get("replicas") or 0)
        status["readyReplicas"] = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
        _keep_measured(previous, status, generation)
        return finish(Facts(sized=sized, blocker=blocker, rollout=rollout_from(deployment, keep, pods),
                            endpoint=status["endpoint"]))

    if sizing is None or not sizing.feasible:
        return stuck(None)
    if foreign:
        kinds = ", ".join(f"{k} {name}" for k in foreign)
        return stuck(("NameConflict", f"{kinds} already exists and is not owned by this InferenceService"))
    if spec.api_key_secret is not None:
        problem = _secret_problem(api, ns, *spec.api_key_secret)
        if problem is not None:
            return stuck(("SecretNotFound", problem))

    # --- replicas: fixed, or the autoscaler's decision; then the GPU quota cap ---
    ready = [p for p in pods if is_ready(p)]
    readings, metrics_error = {}, None
    source = spec.scaling.metrics_source if spec.scaling else "pods"
    if autoscale and ready:
        try:
            if source == "prometheus":
                readings = query_prometheus(
                    spec.scaling.prometheus_url, ns, name, [p["metadata"]["name"] for p in ready],
                    spec.scaling.prometheus_query, timeout=max(config.metrics_timeout, 3.0),
                )
            else:
                readings = scrape(ready, timeout=config.metrics_timeout)
        except Exception as e:  # Prometheus down or answering garbage: hold, and say so
            metrics_error = f"{spec.scaling.prometheus_url}: {e}"
    measured = metrics.measured_capacity(readings)
    if measured:
        status["sizing"]["measured"] = {**measured, "time": iso(now)}
        if not (previous.get("sizing") or {}).get("measured"):
            events.append(_capacity_event(sizing, measured))
    else:
        _keep_measured(previous, status, generation)
    measured = status["sizing"].get("measured")

    wanted, scaling_cond, decision = _replicas(spec, sizing, current, ready, readings, metrics_error, previous,
                                               measured, config, autoscale, now)
    cap = cap_replicas(wanted, gpus_per_replica(sizing), api.list("ResourceQuota", ns), pods,
                       spec.template.get("priorityClassName"))
    replicas = wanted if cap.max_replicas is None else min(wanted, cap.max_replicas)
    if cap.limited:
        quota_cond = Condition("QuotaLimited", "True", "GPUQuotaExceeded", cap.message)
    elif cap.max_replicas is None:
        quota_cond = Condition("QuotaLimited", "False", "NoGPUQuota", cap.message)
    else:
        quota_cond = Condition("QuotaLimited", "False", "WithinQuota", cap.message)

    # --- children ---
    desired = children.desired_deployment(spec, sizing, replicas, config.engine_image)
    spec_changed = deployment is None or children.differs(
        {**desired["spec"], "replicas": None}, {**deployment.get("spec", {}), "replicas": None})
    if deployment is None:
        deployment = api.apply(desired)
        events.append(("Normal", "Created", f"Deployment {name}: {replicas} replicas x {gpus_per_replica(sizing)} "
                                           f"{spec.gpu_type}, {' '.join(desired['spec']['template']['spec']['containers'][0]['args'])}"))
    elif children.differs(desired, deployment):
        if current is not None and current != replicas:
            why = decision.message if decision is not None and decision.replicas == wanted else scaling_cond.message
            if cap.limited:
                why = cap.message
            events.append(("Normal", "ScaledUp" if replicas > current else "ScaledDown",
                           f"Deployment {name} from {current} to {replicas} replicas: {why}"))
            status.setdefault("scaling", {})["lastScaleTime"] = iso(now)
        deployment = api.apply(desired)
    for kind, want in (("Service", children.desired_service(spec)), ("PodDisruptionBudget", children.desired_pdb(spec))):
        if want is None:
            if live[kind] is not None:
                api.delete(kind, ns, name)
        elif live[kind] is None or children.differs(want, live[kind]):
            api.apply(want)
            if live[kind] is None:
                events.append(("Normal", "Created", f"{kind} {name}"))

    if spec.scaling is not None:
        scaling_status = dict(previous.get("scaling") or {})
        scaling_status.update(status.get("scaling") or {})
        scaling_status["targetQueueDepth"] = decision.target if decision else _target(spec, sizing, measured)
        if decision is not None:
            scaling_status["recommendations"] = [{"time": iso(r.time), "replicas": r.replicas} for r in decision.history]
            if decision.queue_depth is not None:
                scaling_status["currentQueueDepth"] = decision.queue_depth
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


def _target(spec: ServiceSpec, sizing: SizingPlan, measured: dict | None) -> int:
    if spec.scaling is not None and spec.scaling.target_queue_depth is not None:
        return spec.scaling.target_queue_depth
    return capacity_target(sizing, measured)


def _replicas(spec, sizing, current, ready, readings, metrics_error, previous, measured, config, autoscale, now):
    """(wanted replicas, ScalingActive condition, decision or None)."""
    if spec.scaling is None:
        return spec.replicas, Condition("ScalingActive", "False", "FixedReplicas",
                                        f"spec.replicas is {spec.replicas}; autoscaling is off"), None
    s = spec.scaling
    target = _target(spec, sizing, measured)
    clamped = None if current is None else max(s.min_replicas, min(s.max_replicas, current))
    prev_cond = next((c for c in previous.get("conditions") or [] if c.get("type") == "ScalingActive"), None)
    if current is None or not autoscale:
        if prev_cond and prev_cond.get("reason") not in ("FixedReplicas", "NotSized"):
            cond = Condition("ScalingActive", prev_cond["status"], prev_cond.get("reason", ""), prev_cond.get("message", ""))
        else:
            cond = Condition("ScalingActive", "False", "WaitingForMetrics",
                             f"starting at {clamped or s.min_replicas} replicas; queue depth is read every "
                             f"{config.interval:g}s once pods are ready")
        return (s.min_replicas if current is None else clamped), cond, None
    history = _history(previous)
    if metrics_error is not None:
        decision = autoscaler.ScaleDecision(clamped, False, "MetricsUnavailable",
                                            f"cannot query Prometheus at {metrics_error}; holding at {clamped} replicas",
                                            None, target, history)
    elif metrics.TOTAL in readings:
        decision = autoscaler.decide_with_total(s, current, readings[metrics.TOTAL].queue_depth, target, history, now)
    else:
        per_pod = {pod: (r.queue_depth, r.timestamp) for pod, r in readings.items()}
        decision = autoscaler.decide(s, current, [p["metadata"]["name"] for p in ready], per_pod, target, history,
                                     now, config.stale_after)
    cond = Condition("ScalingActive", "True" if decision.active else "False", decision.reason, decision.message)
    return decision.replicas, cond, decision


def _keep_measured(previous: dict, status: dict, generation: int) -> None:
    """Carry the last measurement over while it describes the current generation's pods."""
    old = (previous.get("sizing") or {}).get("measured")
    if old and previous.get("observedGeneration") == generation and "sizing" in status:
        status["sizing"]["measured"] = old


def _capacity_event(sizing: SizingPlan, measured: dict) -> tuple[str, str, str]:
    tokens = measured.get("kvTokens")
    text = f"engines report {tokens} KV tokens per replica (estimate {sizing.kv_tokens})"
    if tokens and abs(tokens - sizing.kv_tokens) > 0.05 * sizing.kv_tokens:
        return ("Warning", "CapacityMismatch", text + ": the model profile may not match the weights")
    return ("Normal", "CapacityMeasured", text)


def _secret_problem(api, namespace: str, secret: str, key: str) -> str | None:
    try:
        keys = api.secret_keys(namespace, secret)
    except KubeError as e:
        if e.status == 403:
            # Not allowed to read Secrets here: the pod will say so (CreateContainerConfigError).
            return None
        raise
    if keys is None:
        return f"Secret {secret} (spec.apiKeySecretRef) not found in namespace {namespace}"
    if key not in keys:
        return f"Secret {secret} has no key {key!r} (keys: {', '.join(sorted(keys)) or 'none'})"
    return None
