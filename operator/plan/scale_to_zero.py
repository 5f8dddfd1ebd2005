"""Scale to zero and back (scaling.minReplicas 0, routed services only). Pure: readings and the state kept in
status.scaling in; the replica override, the ScaledToZero condition and the new state out.

- Idle: a reading with no request anywhere (nothing waiting or running in the engines, nothing held by the
  router's flow control, no new prompt tokens since the last reading) leaves `lastActiveTime` where it
  was; after `idleSeconds` of that the service goes to 0 replicas. Missing readings never count as idle.
- Wake: at 0 replicas the router holds each request (its queue TTL is the startup budget, plan/startup.py);
  the operator reads the router's queue every WAKE_POLL_SECONDS and asks for 1 replica the moment it is
  not empty, ahead of any stabilization window (the quota and Kueue bounds still apply after this).
- The wake's measured time (from the reading that saw the held request to the first replica's Ready) is
  kept beside the predicted one: the last measured wake, else the last measured pod start (creation to
  Ready, e.g. the service's first replica), else the engines' measured model load time (which leaves out
  the process start and model conversion), else the startup budget (the bound, not an estimate).
"""

from dataclasses import dataclass

from tokenmill.operator.plan.conditions import Condition

# While at zero the operator reads the router's queue this often (its usual interval may be 15 s).
WAKE_POLL_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class ZeroState:
    """What status.scaling keeps between readings."""

    last_active: float | None = None  # unix seconds of the last reading that saw a request
    prompt_tokens: float | None = None  # the engines' prompt token total at the last reading
    wake_requested: float | None = None  # when the running wake saw its held request
    last_wake_seconds: float | None = None
    pod_start_seconds: float | None = None  # the last measured start of a replica: created -> Ready


@dataclass(frozen=True, slots=True)
class Readings:
    """One pass's view: None where nothing could be read."""

    engines_busy: bool | None  # any waiting or running request in the ready engines (None: not read)
    prompt_tokens: float | None  # summed over the ready engines
    router_queue: float | None  # requests the router's flow control holds
    ready: int = 0  # ready replicas now
    first_ready_at: float | None = None  # when the earliest ready replica became Ready
    pod_start_seconds: float | None = None  # the newest ready replica's creation -> Ready


@dataclass(frozen=True, slots=True)
class ZeroDecision:
    replicas: int | None  # an override of the autoscaler's size (0, or 1 to wake); None: none
    condition: Condition  # ScaledToZero
    state: ZeroState  # to keep in status.scaling
    wake_seconds: float | None = None  # a wake that finished at this reading, measured
    why: str = ""  # what the ScaledUp / ScaledDown event says


def predicted_wake(last_wake: float | None, pod_start: float | None, model_load_seconds: float | None,
                   budget: int) -> tuple[float, str]:
    """(seconds, what they are) for status.scaling.wake."""
    if last_wake is not None:
        return round(last_wake, 1), "lastWake"
    if pod_start is not None:
        return round(pod_start, 1), "podStart"
    if model_load_seconds:
        return round(float(model_load_seconds), 1), "modelLoadSeconds"
    return float(budget), "startupBudget"


def decide_zero(idle_seconds: int, current: int, r: Readings, s: ZeroState, active_decision: bool,
                now: float) -> ZeroDecision:
    """`current`: the workload's replicas; `active_decision`: the autoscaler read fresh metrics from every
    ready pod this pass (so a quiet reading means quiet, not unread)."""
    tokens_moved = r.prompt_tokens is not None and s.prompt_tokens is not None and r.prompt_tokens != s.prompt_tokens
    activity = bool(r.router_queue) or bool(r.engines_busy) or tokens_moved
    last_active = now if activity or s.last_active is None else s.last_active
    tokens = r.prompt_tokens if r.prompt_tokens is not None else s.prompt_tokens

    if current == 0:
        if r.router_queue:
            requested = s.wake_requested or now
            return ZeroDecision(1, Condition("ScaledToZero", "False", "Waking",
                                             f"the router holds {r.router_queue:g} request(s): starting 1 replica"),
                                ZeroState(now, tokens, requested, s.last_wake_seconds, s.pod_start_seconds),
                                why=f"the router holds {r.router_queue:g} request(s) for a service at 0 replicas")
        unread = "" if r.router_queue is not None else " (the router's queue could not be read this pass)"
        return ZeroDecision(0, Condition("ScaledToZero", "True", "Idle",
                                         f"0 replicas after {idle_seconds}s without a request; the router holds the "
                                         f"next request and wakes the service{unread}"),
                            ZeroState(last_active, tokens, None, s.last_wake_seconds, s.pod_start_seconds))

    wake_seconds, requested = None, s.wake_requested
    if requested is not None and r.ready >= 1:
        wake_seconds = max(0.0, (r.first_ready_at or now) - requested)
        requested, last_active = None, now  # the idle clock starts when the woken replica serves
    state = ZeroState(last_active, tokens, requested, wake_seconds if wake_seconds is not None else s.last_wake_seconds,
                      r.pod_start_seconds if r.pod_start_seconds is not None else s.pod_start_seconds)
    quiet_for = now - last_active
    if (requested is None and active_decision and r.engines_busy is False and r.router_queue == 0
            and not activity and quiet_for >= idle_seconds):
        why = f"no request for {quiet_for:.0f}s (idleSeconds {idle_seconds})"
        return ZeroDecision(0, Condition("ScaledToZero", "True", "Idle", f"0 replicas: {why}"), state, wake_seconds,
                            why)
    if requested is not None:
        text = f"waking: {r.ready} ready of {current} replica(s)"
    else:
        text = f"{current} replica(s); {quiet_for:.0f}s without a request of the {idle_seconds}s that scale to 0"
    return ZeroDecision(None, Condition("ScaledToZero", "False", "Serving", text), state, wake_seconds)
