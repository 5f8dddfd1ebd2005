"""The autoscaling decision: queue depth against a capacity-derived target, stabilized both ways.

Pure: readings, the current size and the recommendation history in; a decision and the new history
out. The history lives in the object's status, so a restarted (or failed-over) operator continues it.
"""

import math
from dataclasses import dataclass, field

from tokenmill.operator.plan.spec import ScalingSpec

# Prometheus samples older than this are stale: the engine stopped reporting, or the scrape broke.
STALE_AFTER_SECONDS = 120.0


@dataclass(frozen=True, slots=True)
class Recommendation:
    time: float  # unix seconds
    replicas: int


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    replicas: int  # what the Deployment should have (before the quota cap)
    active: bool  # False: metrics missing or stale, the size is held
    reason: str
    message: str
    queue_depth: float | None = None
    target: int = 1
    history: tuple[Recommendation, ...] = field(default=())


def raw_recommendation(
    queue_depths: dict[str, float], ready_pods: list[str], current: int, target: int, scaling: ScalingSpec,
    held: float = 0.0,
) -> int:
    """ceil(total queue depth / target), clamped to [min, max]; `held`: requests the router holds (routed
    services), demand no engine has seen yet.

    Ready pods that did not report count as idle when that would scale up, and as exactly at target
    when that would scale down: a missing reading can never cause a scale in either direction by itself.
    """
    missing = len([p for p in ready_pods if p not in queue_depths])
    total = sum(queue_depths.values()) + held
    up = math.ceil(total / target)
    if up > current:
        wanted = up
    else:
        wanted = min(current, math.ceil((total + missing * target) / target))
    return max(scaling.min_replicas, min(scaling.max_replicas, wanted))


def stabilize(
    history: tuple[Recommendation, ...], raw: int, current: int, now: float, up_window: float, down_window: float
) -> tuple[int, tuple[Recommendation, ...]]:
    """Kubernetes HPA's rule: scale up only to the lowest recommendation of the up window, down only to
    the highest of the down window. History holds change points; each holds until the next."""
    points = [*history, Recommendation(now, raw)] if not history or history[-1].replicas != raw else list(history)

    def in_window(window: float) -> list[int]:
        start = now - window
        values = [p.replicas for p in points if p.time > start]
        before = [p for p in points if p.time <= start]
        if before:
            values.append(before[-1].replicas)  # the one in force when the window opened
        return values or [raw]

    up_rec = min(in_window(up_window))
    down_rec = max(in_window(down_window))
    replicas = current
    if replicas < up_rec:
        replicas = up_rec
    if replicas > down_rec:
        replicas = down_rec
    # Keep what a window may still need: points inside the longest window and the one before it.
    start = now - max(up_window, down_window)
    older = [p for p in points if p.time <= start]
    kept = tuple(older[-1:] + [p for p in points if p.time > start])
    return replicas, kept


def decide(
    scaling: ScalingSpec,
    current: int,
    ready_pods: list[str],
    readings: dict[str, tuple[float, float | None]],
    target: int,
    history: tuple[Recommendation, ...],
    now: float,
    stale_after: float = STALE_AFTER_SECONDS,
    held: float = 0.0,
) -> ScaleDecision:
    """readings: pod -> (queue depth, sample time or None). `current` is the Deployment's replicas; `held`:
    requests the router's flow control holds (routed services)."""
    floor_only = max(scaling.min_replicas, min(scaling.max_replicas, current))

    def hold(reason: str, message: str) -> ScaleDecision:
        return ScaleDecision(floor_only, False, reason, f"{message}; holding at {floor_only} replicas",
                             None, target, history)

    if not ready_pods:
        return hold("NoReadyPods", "no ready engine pods to read the queue depth from")
    fresh, stale = {}, []
    for pod in ready_pods:
        if pod not in readings:
            continue
        depth, ts = readings[pod]
        if ts is not None and now - ts > stale_after:
            stale.append(pod)
        else:
            fresh[pod] = depth
    if not fresh:
        if stale:
            return hold("MetricsStale", f"the newest queue-depth samples of {', '.join(sorted(stale))} are "
                        f"older than {stale_after:g}s")
        return hold("MetricsMissing", f"none of the {len(ready_pods)} ready pods reported "
                    "vllm:num_requests_waiting and vllm:num_requests_running")
    raw = raw_recommendation(fresh, ready_pods, current, target, scaling, held)
    replicas, new_history = stabilize(
        history, raw, current, now, scaling.scale_up_stabilization_seconds, scaling.scale_down_stabilization_seconds
    )
    total = sum(fresh.values()) + held
    missing = [p for p in ready_pods if p not in fresh]
    routed = f" (+{held:g} held by the router)" if held else ""
    text = (f"queue depth {total:g}{routed} over {len(fresh)} reporting pods, target {target} per replica: "
            f"recommend {raw}")
    if replicas != raw:
        text += f", stabilized at {replicas}"
    if missing:
        text += f" ({len(missing)} ready pods without fresh metrics: {', '.join(sorted(missing))})"
    return ScaleDecision(replicas, True, "MetricsAvailable", text, total, target, new_history)


def decide_with_total(
    scaling: ScalingSpec, current: int, total: float, target: int, history: tuple[Recommendation, ...], now: float
) -> ScaleDecision:
    """For a custom Prometheus query that returns one total instead of per-pod values."""
    wanted = max(scaling.min_replicas, min(scaling.max_replicas, math.ceil(total / target)))
    replicas, new_history = stabilize(
        history, wanted, current, now, scaling.scale_up_stabilization_seconds, scaling.scale_down_stabilization_seconds
    )
    text = f"queue depth {total:g} (custom query), target {target} per replica: recommend {wanted}"
    if replicas != wanted:
        text += f", stabilized at {replicas}"
    return ScaleDecision(replicas, True, "MetricsAvailable", text, total, target, new_history)
