"""The status stage: every field of an InferenceService's status, the conditions merged with their
transition times, the events, and the one status patch a reconcile writes.

The conditions themselves are decided in plan/conditions.py from the Facts a reconcile gathers; here
they get their lastTransitionTime and observedGeneration (kstatus), and their transitions become events.
"""

import datetime
import logging
from dataclasses import dataclass, field

from tokenmill.operator.apply import Applied, Event
from tokenmill.operator.children.httproute import gateway_endpoint, gateway_namespace
from tokenmill.operator.children.inferencepool import router_name
from tokenmill.operator.children.leaderworkerset import KIND as LWS_KIND
from tokenmill.operator.children.leaderworkerset import LEADER, ROLE_LABEL
from tokenmill.operator.children.lora_config import lora_config_name
from tokenmill.operator.children.meta import selector_string
from tokenmill.operator.children.router import router_endpoint
from tokenmill.operator.children.service import endpoint
from tokenmill.operator.kube import KubeError, merge_patch
from tokenmill.operator.observe.cluster import Live
from tokenmill.operator.plan.autoscaler import Recommendation, ScaleDecision
from tokenmill.operator.plan.catalog import ModelProfile
from tokenmill.operator.plan.conditions import Condition, Facts, compute_conditions, rollout_from
from tokenmill.operator.plan.kueue import Admission
from tokenmill.operator.plan.observations import TOTAL, EngineReadings, HubModel
from tokenmill.operator.plan.profiles import Sized
from tokenmill.operator.plan.replicas import ReplicaPlan, target
from tokenmill.operator.plan.routing import RouterState, routed_condition
from tokenmill.operator.plan.scale_to_zero import ZeroDecision, ZeroState, predicted_wake
from tokenmill.operator.plan.sizing import SizingPlan, gpus_per_replica, weights_from
from tokenmill.operator.plan.spec import ServiceSpec
from tokenmill.operator.plan.startup import startup_timeout_seconds

log = logging.getLogger("tokenmill.operator")


@dataclass(slots=True)
class Report:
    """What one reconcile writes: the status (conditions still to come), their facts, its events."""

    status: dict
    facts: Facts
    events: list[Event] = field(default_factory=list)


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def own_status(body: dict) -> dict:
    """The status last written, without what Kopf keeps there."""
    return {k: v for k, v in (body.get("status") or {}).items() if k != "kopf"}


def plan_status(p: SizingPlan, profile: ModelProfile | None) -> dict:
    return {
        "model": p.model,
        "profileSource": profile.source if profile else "",
        "feasible": p.feasible,
        "reason": p.reason,
        "message": p.message,
        "gpuType": p.gpu_type,
        "gpusPerReplica": gpus_per_replica(p),
        "nodesPerReplica": p.nodes_per_replica,
        "tensorParallelSize": p.tensor_parallel_size,
        "pipelineParallelSize": p.pipeline_parallel_size,
        "dtype": p.dtype,
        "kvCacheDtype": p.kv_cache_dtype,
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
        "hostMemoryBytes": p.host_memory_bytes,
        "loraSlotBytes": p.lora_slot_bytes,
        **({"quantization": profile.quantization} if profile is not None and profile.quantization else {}),
    }


def hub_status(hub_model: HubModel, profile: ModelProfile | None) -> dict:
    """status.sizing.hub: the repo and commit the plan describes, and which numbers came from it."""
    out = {"repo": hub_model.repo_id, "revision": hub_model.revision, "commit": hub_model.commit,
           "gated": hub_model.gated}
    if hub_model.weights_bytes is not None:
        out["weightsBytes"] = hub_model.weights_bytes
    if profile is not None and profile.source.startswith("hub"):
        out["configFile"] = f"config.json at {hub_model.commit}"
        counted = hub_model.parameters and not profile.quantization  # int4 metadata counts packed words
        out["parametersFrom"] = "safetensors metadata" if counted else "estimated from config.json"
    return out


def sizing_status(spec: ServiceSpec, sized: Sized) -> dict:
    """status.sizing: the plan, or why there is none."""
    if sized.plan is None:
        e = sized.error
        return {"feasible": False, "reason": e.reason, "message": str(e), "gpuType": spec.gpu_type}
    out = plan_status(sized.plan, sized.profile)
    out["weightsFrom"] = weights_from(sized.profile, sized.plan.dtype, spec.model_uri)
    if sized.hub_model is not None:
        out["hub"] = hub_status(sized.hub_model, sized.profile)
    return out


def measurement(previous: dict, sizing: SizingPlan | None, generation: int, measured: dict,
                now: float) -> tuple[dict | None, list[Event]]:
    """status.sizing.measured: the capacity the engines report now (with the first report's event), else
    the last one while it describes the current generation's pods."""
    if measured:
        first = not (previous.get("sizing") or {}).get("measured")
        return {**measured, "time": iso(now)}, [capacity_event(sizing, measured)] if first else []
    old = (previous.get("sizing") or {}).get("measured")
    return (old if old and previous.get("observedGeneration") == generation else None), []


def capacity_event(sizing: SizingPlan, measured: dict) -> tuple[str, str, str]:
    tokens = measured.get("kvTokens")
    text = f"engines report {tokens} KV tokens per replica (estimate {sizing.kv_tokens})"
    if tokens and abs(tokens - sizing.kv_tokens) > 0.05 * sizing.kv_tokens:
        return ("Warning", "CapacityMismatch", text + ": the model profile may not match the weights")
    return ("Normal", "CapacityMeasured", text)


def recommendations(previous: dict) -> tuple[Recommendation, ...]:
    """The autoscaler's history, as scaling_status wrote it (a restarted operator continues it)."""
    out = []
    for item in ((previous.get("scaling") or {}).get("recommendations")) or []:
        try:
            out.append(Recommendation(from_iso(item["time"]), int(item["replicas"])))
        except (KeyError, ValueError, TypeError):
            continue  # a hand-edited status: drop the entry rather than fail
    return tuple(sorted(out, key=lambda r: r.time))


def zero_state(previous: dict) -> ZeroState:
    """What status.scaling keeps for scale to zero (plan/scale_to_zero.py)."""
    s = previous.get("scaling") or {}
    wake = s.get("wake") or {}

    def ts(text) -> float | None:
        try:
            return from_iso(text) if text else None
        except (ValueError, TypeError):
            return None  # a hand-edited status: start over rather than fail

    def number(value) -> float | None:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return ZeroState(ts(s.get("lastActiveTime")), number(s.get("promptTokens")), ts(wake.get("requestedTime")),
                     number(wake.get("lastSeconds")), number(wake.get("podStartSeconds")))


def scaling_status(spec: ServiceSpec, sizing: SizingPlan, previous: dict, decision: ScaleDecision | None,
                   measured: dict | None, scaled_at: str | None, zero: ZeroDecision | None = None,
                   held: float | None = None, now: float = 0.0) -> dict | None:
    """status.scaling of an autoscaled service (None for a fixed size); `zero` and `held` for scale to zero
    and the router's queue (routed services)."""
    if spec.scaling is None:
        return None
    out = dict(previous.get("scaling") or {})
    if scaled_at is not None:
        out["lastScaleTime"] = scaled_at
    out["targetQueueDepth"] = decision.target if decision else target(spec, sizing, measured)
    if decision is not None:
        out["recommendations"] = [{"time": iso(r.time), "replicas": r.replicas} for r in decision.history]
        if decision.queue_depth is not None:
            out["currentQueueDepth"] = decision.queue_depth
    if held is not None:
        out["routerQueueDepth"] = held
    if spec.scaling.min_replicas == 0:
        wake = dict(out.get("wake") or {})
        if zero is not None:
            st = zero.state
            if st.last_active is not None:
                out["lastActiveTime"] = iso(st.last_active)
            if st.prompt_tokens is not None:
                out["promptTokens"] = st.prompt_tokens
            if st.wake_requested is not None:
                wake["requestedTime"] = iso(st.wake_requested)
            else:
                wake.pop("requestedTime", None)  # no wake running
            if zero.wake_seconds is not None:
                wake["lastSeconds"] = round(zero.wake_seconds, 1)
                wake["lastTime"] = iso(now)
            if st.pod_start_seconds is not None:
                wake["podStartSeconds"] = round(st.pod_start_seconds, 1)
        budget = startup_timeout_seconds(spec, sizing)
        predicted, source = predicted_wake(wake.get("lastSeconds"), wake.get("podStartSeconds"),
                                           (measured or {}).get("modelLoadSeconds"), budget)
        out["wake"] = {**wake, "budgetSeconds": budget, "predictedSeconds": predicted, "predictedFrom": source}
    return out


def lora_status(spec: ServiceSpec, engines: EngineReadings, previous: dict) -> dict | None:
    """status.lora: each adapter of spec.model.lora and whether every ready pod reports it loaded
    (tokenmill:lora_adapter_info from the pods' /metrics). A pass that read no pod keeps the last answer
    for the adapters still listed."""
    if spec.lora is None:
        return None
    pods = [r for key, r in engines.readings.items() if key != TOTAL]
    old = {a.get("name"): a for a in (previous.get("lora") or {}).get("adapters") or []}
    adapters = []
    for a in spec.lora.adapters:
        kept = old.get(a.name)
        if not pods and kept is not None and kept.get("uri") == a.uri:
            adapters.append(kept)
            continue
        states = [r.lora.get(a.name) for r in pods]
        loaded = sum(1 for s in states if s is not None and s[0] == "loaded")
        entry = {"name": a.name, "uri": a.uri, "loaded": bool(pods) and loaded == len(pods),
                 "pods": f"{loaded}/{len(pods)}"}  # fmt: skip
        failed = [s[1] for s in states if s is not None and s[0] == "failed"]
        if failed:
            entry["reason"] = failed[0]
        elif not pods:
            entry["reason"] = "no ready engine pod has reported yet"
        elif loaded < len(pods):
            entry["reason"] = "not yet loaded by every ready pod (the kubelet passes a ConfigMap change on within about a minute)"
        adapters.append(entry)
    return {"configMap": lora_config_name(spec), "loaded": sum(1 for e in adapters if e["loaded"]), "adapters": adapters}


def router_state(spec: ServiceSpec, live: Live) -> RouterState | None:
    """What the router looks like (plan/routing.py decides the Routed condition from it)."""
    if spec.routing is None:
        return None
    r = live.router
    deployment = r.objects.get("Deployment") or {}
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    if spec.routing.gateway_name is None:
        return RouterState("standalone", spec.name, ready, router_endpoint(spec))
    gateway = f"{gateway_namespace(spec)}/{spec.routing.gateway_name}"
    accepted = None
    for parent in ((r.objects.get("HTTPRoute") or {}).get("status") or {}).get("parents") or []:
        ref = parent.get("parentRef") or {}
        if ref.get("name") == spec.routing.gateway_name:
            for c in parent.get("conditions") or []:
                if c.get("type") == "Accepted":
                    accepted = (c.get("status", "Unknown"), c.get("message") or c.get("reason", ""))
    return RouterState("gateway", spec.name, ready, gateway_endpoint(spec, r.gateway), gateway,
                       r.gateway is not None, accepted)


def routing_status(spec: ServiceSpec, state: RouterState) -> dict:
    out = {"mode": state.mode, "inferencePool": spec.name, "endpointPicker": router_name(spec),
           "readyPickers": state.ready_pods}
    if state.mode == "gateway":
        out["httpRoute"] = spec.name
    return out


def _status(spec: ServiceSpec, sized: Sized, live: Live, measured: dict | None, desired: int,
            workload: dict | None) -> dict:
    selector = selector_string(spec.name)
    if live.workload_kind == LWS_KIND:
        selector += f",{ROLE_LABEL}={LEADER}"  # the leaders: one per replica, for the scale subresource
    status = {"observedGeneration": spec.generation, "selector": selector, "endpoint": endpoint(spec),
              "sizing": sizing_status(spec, sized)}
    state = router_state(spec, live)
    if state is not None:
        # The one URL clients use: the router's (the engine Service stays, unrouted, for direct access).
        status["routing"] = routing_status(spec, state)
        if state.endpoint is None:
            del status["endpoint"]
        else:
            status["endpoint"] = state.endpoint
    if measured:
        status["sizing"]["measured"] = measured
    counts = (workload or {}).get("status") or {}
    status["desiredReplicas"] = desired
    status["replicas"] = int(counts.get("replicas") or 0)
    status["readyReplicas"] = int(counts.get("readyReplicas") or 0)
    return status


def invalid(body: dict, error: str) -> Report:
    """A spec that does not parse: only the generation, the selector and the conditions."""
    meta = body.get("metadata") or {}
    status = {"observedGeneration": int(meta.get("generation") or 0), "selector": selector_string(meta.get("name"))}
    return Report(status, Facts(spec_error=error))


def held(spec: ServiceSpec, sized: Sized, live: Live, previous: dict, blocker: tuple[str, str] | None,
         now: float) -> Report:
    """Infeasible or blocked: nothing was created, and a running workload was left as it is (a bad edit
    must not take down a service that works); the conditions say why."""
    keep = live.current if live.current is not None else 0
    measured, _ = measurement(previous, sized.plan, spec.generation, {}, now)
    status = _status(spec, sized, live, measured, keep, live.workload)
    return Report(status, Facts(sized=sized.condition, blocker=blocker, rollout=rollout_from(live.workload, keep, live.pods),
                                endpoint=status.get("endpoint", "")))


def serving(spec: ServiceSpec, sized: Sized, live: Live, previous: dict, replicas: ReplicaPlan, applied: Applied,
            measured: dict | None, events: list[Event], now: float, queue: Admission | None = None) -> Report:
    """The children applied: their counts, the scaling history and the rollout's conditions; `queue`:
    Kueue's admission, for a service in a Kueue queue."""
    status = _status(spec, sized, live, measured, replicas.replicas, applied.workload)
    scaling = scaling_status(spec, sized.plan, previous, replicas.decision, measured,
                             iso(now) if applied.scaled else None, replicas.zero, replicas.held, now)
    if replicas.zero is not None and replicas.zero.wake_seconds is not None:
        wake = scaling["wake"]
        events.append(("Normal", "Woke", f"the first replica was ready {wake['lastSeconds']}s after the held request "
                       f"was seen (budget {wake['budgetSeconds']}s, the router's queue TTL)"))
    if scaling is not None:
        status["scaling"] = scaling
    floor = spec.scaling.min_replicas if spec.scaling is not None else None
    rollout = rollout_from(applied.workload, replicas.replicas, live.pods, floor, applied.spec_changed)
    kueue = {} if queue is None else {"admitted": queue.admitted, "scaling_limited": replicas.limited,
                                      "kueue_holding": queue.holding}
    state = router_state(spec, live)
    routed = {}
    if state is not None:
        condition, stall = routed_condition(state)
        routed = {"routed": condition, "route_stall": stall}
    if replicas.zero is not None:
        routed["scaled_to_zero"] = replicas.zero.condition
    elif spec.scaling is not None and spec.scaling.min_replicas == 0:
        kept = next((c for c in previous.get("conditions") or [] if c.get("type") == "ScaledToZero"), None)
        if kept is not None:  # no reading this pass (a watch event): the last one stands
            routed["scaled_to_zero"] = Condition("ScaledToZero", kept["status"], kept.get("reason", ""),
                                                 kept.get("message", ""))
    return Report(status, Facts(sized=sized.condition, rollout=rollout, quota=replicas.quota,
                                scaling=replicas.scaling, endpoint=status.get("endpoint", ""), **kueue, **routed),
                  events)


def write_status(api, body: dict, previous: dict, report: Report, now: float) -> dict:
    """Merge the conditions, patch what changed (nothing in a steady state) and post the events."""
    meta = body.get("metadata") or {}
    ns, name = meta.get("namespace"), meta.get("name")
    status, generation = report.status, report.status["observedGeneration"]
    conditions = compute_conditions(report.facts)
    status["conditions"] = merge_conditions(previous.get("conditions"), conditions, generation, iso(now))
    events = [*report.events, *transition_events(previous.get("conditions"), conditions)]
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


def merge_conditions(previous: list[dict] | None, new: list[Condition], generation: int, now: str) -> list[dict]:
    """metav1.Condition dicts; lastTransitionTime moves only when the status flips."""
    old = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    out = []
    for cond in new:
        prev = old.get(cond.type)
        changed = prev is None or prev.get("status") != cond.status
        out.append({
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": now if changed else prev.get("lastTransitionTime", now),
            "observedGeneration": generation,
        })
    return out


PROGRESS_REASONS = {"Creating", "RollingOut", "WaitingForReplicas", "ScalingDown", "QueuedByKueue",
                    "RouterStarting", "WaitingForGateway"}
# Admitted=False for these needs attention (a Warning event); waiting in the queue does not.
KUEUE_BAD_REASONS = {"Preempted", "Evicted", "LocalQueueNotFound"}


def is_bad(cond: Condition) -> bool:
    """Whether a condition asks for attention (a Warning event)."""
    if cond.status == "Unknown":
        return True
    if cond.type in ("Stalled", "QuotaLimited"):
        return cond.status == "True"
    if cond.type in ("Reconciling", "ScalingLimited", "ScaledToZero"):
        return False  # ScalingLimited: the queue's bound working as meant (as the HPA's condition)
    if cond.type == "Admitted":
        return cond.status == "False" and cond.reason in KUEUE_BAD_REASONS
    if cond.type == "ScalingActive":
        return cond.status == "False" and cond.reason not in ("FixedReplicas", "NotSized", "WaitingForMetrics",
                                                              "NoReadyPods")
    if cond.type in ("Ready", "Routed") and cond.reason in PROGRESS_REASONS:
        return False  # on its way, not in trouble
    return cond.status == "False"  # Ready, Sized


def transition_events(previous: list[dict] | None, new: list[Condition]) -> list[tuple[str, str, str]]:
    """(type, reason, message) for each condition whose status or reason changed. Reconciling is left
    out (Ready carries the same news); a first status is news for Sized, and for others when bad."""
    old = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    events = []
    for cond in new:
        if cond.type == "Reconciling":
            continue
        prev = old.get(cond.type)
        if prev is not None and prev.get("status") == cond.status:
            before = Condition(cond.type, prev.get("status", ""), prev.get("reason", ""), "")
            if prev.get("reason") == cond.reason or (not is_bad(before) and not is_bad(cond)):
                continue  # same news, or progress on the way (RollingOut -> WaitingForReplicas)
        if prev is None and cond.type != "Sized" and not is_bad(cond) and cond.type != "Ready":
            continue
        if prev is None and cond.type == "Ready" and cond.status != "True":
            continue  # "Creating" on a new object is not news
        kind = "Warning" if is_bad(cond) else "Normal"
        events.append((kind, cond.reason, f"{cond.type}={cond.status}: {cond.message}"))
    return events
