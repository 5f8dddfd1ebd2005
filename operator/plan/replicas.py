"""How many replicas an InferenceService runs: the fixed size, or the autoscaler's decision from the
ready pods' queue depth; then the GPU quota cap. Pure: the engines' readings, the quotas, the pods and
the previous status come in (observe/ reads them).

The stabilization rule itself is autoscaler.py's; this module gathers its inputs (the capacity target,
the recommendation history kept in status) and turns the outcome into conditions.
"""

import dataclasses
import datetime
from dataclasses import dataclass

from tokenmill.operator.plan import autoscaler
from tokenmill.operator.plan.conditions import Condition
from tokenmill.operator.plan.kueue import Admission, queue_cap
from tokenmill.operator.plan.observations import TOTAL, EngineReadings
from tokenmill.operator.plan.quota import QuotaCap, cap_replicas
from tokenmill.operator.plan.scale_to_zero import Readings, ZeroDecision, ZeroState, decide_zero
from tokenmill.operator.plan.sizing import REFERENCE_SEQUENCE_TOKENS, SizingPlan, gpus_per_replica
from tokenmill.operator.plan.spec import ServiceSpec


def capacity_target(p: SizingPlan, measured: dict | None) -> int:
    """Requests one replica serves without queueing: the planned target, or the same rule applied to
    the KV tokens the engines report once they run (the closed loop)."""
    tokens = (measured or {}).get("kvTokens")
    if not tokens:
        return p.target_queue_depth
    per_seq = -(-min(p.max_model_len, REFERENCE_SEQUENCE_TOKENS) // p.block_size)
    return max(1, min(p.max_num_seqs, (int(tokens) // p.block_size) // per_seq))


def target(spec: ServiceSpec, sizing: SizingPlan, measured: dict | None) -> int:
    if spec.scaling is not None and spec.scaling.target_queue_depth is not None:
        return spec.scaling.target_queue_depth
    return capacity_target(sizing, measured)


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    replicas: int  # what the workload gets: the fixed size or the autoscaler's, capped by the GPU quota
    scaling: Condition  # ScalingActive
    quota: Condition  # QuotaLimited
    decision: autoscaler.ScaleDecision | None  # the autoscaler's, when it decided this pass
    why: str  # what an event about a change of size says
    limited: Condition | None = None  # ScalingLimited, for a service in a Kueue queue
    zero: ZeroDecision | None = None  # scale to zero (minReplicas 0), when decided this pass
    held: float | None = None  # requests the router's flow control held at this pass's reading


def plan_replicas(spec: ServiceSpec, sizing: SizingPlan, *, current: int | None, engines: EngineReadings,
                  measured: dict | None, previous: dict, history: tuple[autoscaler.Recommendation, ...],
                  quotas: list[dict], pods: list[dict], interval: float, stale_after: float, autoscale: bool,
                  now: float, queue: Admission | None = None, zero_state: ZeroState | None = None) -> ReplicaPlan:
    """`current`: the workload's replicas (None before it exists); `previous`: the status last written,
    `history` its recommendations; `pods`: this service's pods, whose GPUs count as its own headroom;
    `queue`: Kueue's admission of them, when the service is in a Kueue queue; `zero_state`: what
    status.scaling keeps for scale to zero (minReplicas 0)."""
    wanted, scaling, decision = decide_replicas(spec, sizing, current, engines, measured, previous, history,
                                                interval, stale_after, autoscale, now)
    zero = None
    if spec.scaling is not None and spec.scaling.min_replicas == 0 and autoscale and current is not None:
        zero = decide_zero(spec.scaling.idle_seconds, current, zero_readings(engines), zero_state or ZeroState(),
                           decision is not None and decision.reason == "MetricsAvailable", now)
        if zero.replicas is not None:
            wanted = zero.replicas
            if zero.replicas == 1 and current == 0:
                scaling = Condition("ScalingActive", "True", "WakingFromZero", zero.why)
            elif zero.replicas == 0 and current > 0:
                scaling = Condition("ScalingActive", "True", "Idle", zero.why)
    per_replica = gpus_per_replica(sizing)
    cap = cap_replicas(wanted, per_replica, quotas, pods, spec.template.get("priorityClassName"))
    replicas = wanted if cap.max_replicas is None else min(wanted, cap.max_replicas)
    why = cap.message if cap.limited else scaling.message
    limited = None
    if queue is not None:
        replicas, limited, queue_why = limit_by_queue(spec, queue, per_replica, wanted, replicas, current, cap)
        why = queue_why or why
        kept = next((c for c in previous.get("conditions") or [] if c.get("type") == "ScalingLimited"), None)
        if spec.scaling is not None and decision is None and kept is not None:
            # No autoscaling decision this pass (a watch event): the last decision's condition stands, as
            # ScalingActive's does, rather than flapping between passes.
            limited = Condition("ScalingLimited", kept["status"], kept.get("reason", ""), kept.get("message", ""))
    if zero is not None and zero.why and not cap.limited:
        why = zero.why
    return ReplicaPlan(replicas, scaling, quota_condition(cap), decision, why, limited, zero, engines.router_queue)


def zero_readings(engines: EngineReadings) -> Readings:
    """What scale to zero reads from one pass (plan/scale_to_zero.py): engines_busy and prompt_tokens are
    None unless every ready pod was read."""
    pods = [r for name, r in engines.readings.items() if name != TOTAL]
    ready_times = _ready_times(engines.ready)
    complete = engines.error is None and TOTAL not in engines.readings and len(pods) == len(engines.ready)
    busy = any(r.queue_depth > 0 for r in engines.readings.values())
    tokens = [r.prompt_tokens for r in pods if r.prompt_tokens is not None]
    return Readings(engines_busy=busy or (None if not complete else False),
                    prompt_tokens=sum(tokens) if complete and pods and len(tokens) == len(pods) else None,
                    router_queue=engines.router_queue, ready=len(engines.ready),
                    first_ready_at=min(ready_times.values()) if ready_times else None,
                    pod_start_seconds=_newest_start(engines.ready, ready_times))


def _time(text: str | None) -> float | None:
    try:
        return datetime.datetime.strptime(text or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return None


def _ready_times(pods: list[dict]) -> dict[str, float]:
    """Pod name -> when it became Ready (its condition's lastTransitionTime)."""
    out = {}
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") == "True":
                at = _time(c.get("lastTransitionTime"))
                if at is not None:
                    out[pod["metadata"]["name"]] = at
    return out


def _newest_start(pods: list[dict], ready_times: dict[str, float]) -> float | None:
    """Creation to Ready of the newest ready pod: how long a replica took to start, the last time one did."""
    starts = [(ready_times[name], ready_times[name] - created) for p in pods
              if (name := p["metadata"]["name"]) in ready_times
              and (created := _time(p["metadata"].get("creationTimestamp"))) is not None]
    return max(starts)[1] if starts else None


def limit_by_queue(spec: ServiceSpec, queue: Admission, per_replica: int, wanted: int, replicas: int,
                   current: int | None, cap: QuotaCap) -> tuple[int, Condition, str | None]:
    """The autoscaler asks the ClusterQueue only for what it can admit: a scale-up stops there. It never
    scales down for the queue (a replica Kueue holds, preempted or not, waits in the queue) and never
    below minReplicas; a fixed size is Kueue's to queue. (replicas, ScalingLimited, the event's why)."""
    rq = f"; {cap.message}" if cap.max_replicas is not None else ""
    if spec.scaling is None:
        return replicas, Condition("ScalingLimited", "False", "FixedReplicas",
                                   f"spec.replicas is {spec.replicas}: Kueue queues what its ClusterQueue cannot "
                                   f"admit{rq}"), None
    if queue.quota is None:
        return replicas, Condition("ScalingLimited", "False", "QueueQuotaUnknown",
                                   f"{queue.admitted.message}: no ClusterQueue numbers to bound scaling by{rq}"), None
    qcap = queue_cap(queue.quota, queue.own_gpus, per_replica)
    if qcap.max_replicas is None:
        bound = replicas
    else:
        bound = min(replicas, max(qcap.max_replicas, spec.scaling.min_replicas, min(current or 0, wanted)))
    if bound < wanted:
        holds = "the ClusterQueue" if bound < replicas else "the ResourceQuota"
        text = f"the autoscaler wants {wanted} replicas; {qcap.message}{rq}: held at {bound} ({holds} bound holds)"
        return bound, Condition("ScalingLimited", "True", "QueueQuota" if bound < replicas else "GPUQuotaExceeded",
                                text), text
    return bound, Condition("ScalingLimited", "False", "WithinQueueQuota", f"{wanted} replicas wanted; {qcap.message}{rq}"), None


def decide_replicas(spec: ServiceSpec, sizing: SizingPlan, current: int | None, engines: EngineReadings,
                    measured: dict | None, previous: dict, history: tuple[autoscaler.Recommendation, ...],
                    interval: float, stale_after: float, autoscale: bool,
                    now: float) -> tuple[int, Condition, autoscaler.ScaleDecision | None]:
    """(wanted replicas, ScalingActive condition, decision or None)."""
    if spec.scaling is None:
        return spec.replicas, Condition("ScalingActive", "False", "FixedReplicas",
                                        f"spec.replicas is {spec.replicas}; autoscaling is off"), None
    s = spec.scaling
    tgt = target(spec, sizing, measured)
    clamped = None if current is None else max(s.min_replicas, min(s.max_replicas, current))
    if s.min_replicas == 0:
        # Scale to zero is plan/scale_to_zero.py's (idleSeconds, the router's queue); the queue-depth
        # autoscaler works from 1 replica up, and a new service starts at 1 (its first load is measured).
        if current is None:
            return 1, Condition("ScalingActive", "False", "WaitingForMetrics",
                                "starting at 1 replica; it goes to 0 after idleSeconds without a request"), None
        if current == 0:
            return 0, Condition("ScalingActive", "True", "ScaledToZero",
                                "0 replicas: the router's queue is read every second and wakes the service"), None
        s = dataclasses.replace(s, min_replicas=1)
    prev_cond = next((c for c in previous.get("conditions") or [] if c.get("type") == "ScalingActive"), None)
    if current is None or not autoscale:
        if prev_cond and prev_cond.get("reason") not in ("FixedReplicas", "NotSized"):
            cond = Condition("ScalingActive", prev_cond["status"], prev_cond.get("reason", ""), prev_cond.get("message", ""))
        else:
            cond = Condition("ScalingActive", "False", "WaitingForMetrics",
                             f"starting at {clamped or s.min_replicas} replicas; queue depth is read every "
                             f"{interval:g}s once pods are ready")
        return (s.min_replicas if current is None else clamped), cond, None
    if engines.error is not None:
        decision = autoscaler.ScaleDecision(clamped, False, "MetricsUnavailable",
                                            f"{engines.error}; holding at {clamped} replicas",
                                            None, tgt, history)
    elif TOTAL in engines.readings:
        decision = autoscaler.decide_with_total(s, current, engines.readings[TOTAL].queue_depth, tgt, history, now)
    else:
        per_pod = {pod: (r.queue_depth, r.timestamp) for pod, r in engines.readings.items()}
        decision = autoscaler.decide(s, current, [p["metadata"]["name"] for p in engines.ready], per_pod, tgt,
                                     history, now, stale_after, held=engines.router_queue or 0.0)
    cond = Condition("ScalingActive", "True" if decision.active else "False", decision.reason, decision.message)
    return decision.replicas, cond, decision


def quota_condition(cap: QuotaCap) -> Condition:
    if cap.limited:
        return Condition("QuotaLimited", "True", "GPUQuotaExceeded", cap.message)
    if cap.max_replicas is None:
        return Condition("QuotaLimited", "False", "NoGPUQuota", cap.message)
    return Condition("QuotaLimited", "False", "WithinQuota", cap.message)
