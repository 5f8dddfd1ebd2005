"""How many replicas an InferenceService runs: the fixed size, or the autoscaler's decision from the
ready pods' queue depth (read from the pods or from Prometheus); then the GPU quota cap.

The stabilization rule itself is autoscaler.py's; this module gathers its inputs (readings, the
recommendation history kept in status, the capacity target) and turns the outcome into conditions.
"""

from tokenmill.operator.observe import engine_metrics as metrics
from tokenmill.operator.plan import autoscaler
from tokenmill.operator.plan.conditions import Condition
from tokenmill.operator.plan.quota import QuotaCap
from tokenmill.operator.plan.sizing import REFERENCE_SEQUENCE_TOKENS, SizingPlan
from tokenmill.operator.plan.spec import ServiceSpec
from tokenmill.operator.status import from_iso, iso


def is_ready(pod: dict) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


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


def history(previous: dict) -> tuple[autoscaler.Recommendation, ...]:
    out = []
    for item in ((previous.get("scaling") or {}).get("recommendations")) or []:
        try:
            out.append(autoscaler.Recommendation(from_iso(item["time"]), int(item["replicas"])))
        except (KeyError, ValueError, TypeError):
            continue  # a hand-edited status: drop the entry rather than fail
    return tuple(sorted(out, key=lambda r: r.time))


def read_metrics(spec: ServiceSpec, ready: list[dict], config, scrape, query_prometheus):
    """(readings by pod, error text or None) for the ready pods. A fixed-size service (spec.scaling
    None) is read from its pods too: the readings fill status.sizing.measured."""
    if spec.scaling is not None and spec.scaling.metrics_source == "prometheus":
        try:
            return query_prometheus(
                spec.scaling.prometheus_url, spec.namespace, spec.name, [p["metadata"]["name"] for p in ready],
                spec.scaling.prometheus_query, timeout=max(config.metrics_timeout, 3.0),
            ), None
        except Exception as e:  # Prometheus down or answering garbage: hold, and say so
            return {}, f"cannot query Prometheus at {spec.scaling.prometheus_url}: {e}"
    try:
        return scrape(ready, timeout=config.metrics_timeout), None
    except Exception as e:
        return {}, f"cannot read the pods' /metrics: {e}"


def decide_replicas(spec, sizing, current, ready, readings, metrics_error, previous, measured, config, autoscale,
                    now):
    """(wanted replicas, ScalingActive condition, decision or None)."""
    if spec.scaling is None:
        return spec.replicas, Condition("ScalingActive", "False", "FixedReplicas",
                                        f"spec.replicas is {spec.replicas}; autoscaling is off"), None
    s = spec.scaling
    tgt = target(spec, sizing, measured)
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
    past = history(previous)
    if metrics_error is not None:
        decision = autoscaler.ScaleDecision(clamped, False, "MetricsUnavailable",
                                            f"{metrics_error}; holding at {clamped} replicas",
                                            None, tgt, past)
    elif metrics.TOTAL in readings:
        decision = autoscaler.decide_with_total(s, current, readings[metrics.TOTAL].queue_depth, tgt, past, now)
    else:
        per_pod = {pod: (r.queue_depth, r.timestamp) for pod, r in readings.items()}
        decision = autoscaler.decide(s, current, [p["metadata"]["name"] for p in ready], per_pod, tgt, past,
                                     now, config.stale_after)
    cond = Condition("ScalingActive", "True" if decision.active else "False", decision.reason, decision.message)
    return decision.replicas, cond, decision


def quota_condition(cap: QuotaCap) -> Condition:
    if cap.limited:
        return Condition("QuotaLimited", "True", "GPUQuotaExceeded", cap.message)
    if cap.max_replicas is None:
        return Condition("QuotaLimited", "False", "NoGPUQuota", cap.message)
    return Condition("QuotaLimited", "False", "WithinQuota", cap.message)


def scaling_status(spec: ServiceSpec, sizing: SizingPlan, previous: dict, status: dict, decision,
                   measured: dict | None) -> dict | None:
    """status.scaling of an autoscaled service (None for a fixed size)."""
    if spec.scaling is None:
        return None
    out = dict(previous.get("scaling") or {})
    out.update(status.get("scaling") or {})
    out["targetQueueDepth"] = decision.target if decision else target(spec, sizing, measured)
    if decision is not None:
        out["recommendations"] = [{"time": iso(r.time), "replicas": r.replicas} for r in decision.history]
        if decision.queue_depth is not None:
            out["currentQueueDepth"] = decision.queue_depth
    return out
