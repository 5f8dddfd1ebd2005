"""Status conditions in kstatus conventions (Ready, Reconciling, Stalled) plus Sized, QuotaLimited and
ScalingActive, decided from the Facts one reconcile gathers. status.py merges them into the status
(transition times) and turns their transitions into events.

kstatus reads a resource as Current when observedGeneration equals metadata.generation, Reconciling
and Stalled are not True, and Ready is True; Argo CD's and Flux's health checks follow the same rule.
"""

from dataclasses import dataclass

from tokenmill.operator.plan.spec import KUEUE_GATE

CONDITION_TYPES = ("Ready", "Reconciling", "Stalled", "Sized", "QuotaLimited", "ScalingActive")


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Rollout:
    """What the Deployment and its pods say."""

    exists: bool
    desired: int  # what we asked for
    replicas: int = 0  # pods that exist
    ready: int = 0
    updated: int = 0
    observed_current: bool = True  # the Deployment controller has seen its latest spec
    deadline_exceeded: str | None = None  # ProgressDeadlineExceeded message
    pod_problem: str | None = None  # e.g. "pod x: CrashLoopBackOff: ..."
    pod_blocked: bool = False  # the pod problem needs a human (bad config, missing secret)
    # Ready replicas that count as done: all of them for a fixed size; for an autoscaled service the
    # spec's minReplicas, since replicas the autoscaler adds or removes are operation, not a spec change.
    floor: int | None = None

    @property
    def needed(self) -> int:
        return self.desired if self.floor is None else min(self.floor, self.desired)


def rollout_from(
    deployment: dict | None, desired: int, pods: list[dict], floor: int | None = None, spec_changed: bool = True
) -> Rollout:
    """spec_changed False: this pass only scaled (or changed nothing), so a Deployment generation the
    controller has not observed yet is not a rollout."""
    if deployment is None:
        return Rollout(False, desired, floor=floor)
    meta, status = deployment.get("metadata") or {}, deployment.get("status") or {}
    deadline = None
    for c in status.get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            deadline = c.get("message") or "ProgressDeadlineExceeded"
    problem, blocked = pod_problem(pods)
    return Rollout(
        exists=True,
        desired=desired,
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        observed_current=not spec_changed
        or int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0),
        deadline_exceeded=deadline,
        pod_problem=problem,
        pod_blocked=blocked,
        floor=floor,
    )


# Waiting reasons that will not fix themselves without a change by a human.
BLOCKING_WAIT_REASONS = {"CreateContainerConfigError", "InvalidImageName", "ErrImagePull", "ImagePullBackOff"}


def gated(pod: dict) -> bool:
    """Kueue holds the pod (its scheduling gate): waiting in a queue on purpose, not a pod problem."""
    return any(g.get("name") == KUEUE_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def pod_problem(pods: list[dict]) -> tuple[str | None, bool]:
    """The first reason a pod is not running well, as `pod NAME: REASON: message`; pods Kueue holds are
    the Admitted condition's to explain."""
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if gated(pod):
            continue
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return f"pod {name}: {c.get('reason', 'Unschedulable')}: {c.get('message', '')}".rstrip(": "), False
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason and reason not in ("ContainerCreating", "PodInitializing"):
                text = f"pod {name}: {reason}: {waiting.get('message', '')}".rstrip(": ")
                return text, reason in BLOCKING_WAIT_REASONS
    return None, False


@dataclass(frozen=True, slots=True)
class Facts:
    """Everything the conditions are computed from, gathered by one reconcile."""

    spec_error: str | None = None
    sized: Condition | None = None  # Sized as computed from the plan
    blocker: tuple[str, str] | None = None  # (reason, message): secret missing, name conflict, ...
    rollout: Rollout | None = None
    quota: Condition | None = None
    scaling: Condition | None = None
    endpoint: str = ""
    # Kueue (plan/kueue.py), for a service in a queue: Admitted, ScalingLimited, and whether it holds pods.
    admitted: Condition | None = None
    scaling_limited: Condition | None = None
    kueue_holding: bool = False
    # spec.routing (plan/routing.py): Routed, and what stalls it (a Gateway that is missing or refuses).
    routed: Condition | None = None
    route_stall: tuple[str, str] | None = None
    scaled_to_zero: Condition | None = None  # minReplicas 0 (plan/scale_to_zero.py)


def compute_conditions(f: Facts) -> list[Condition]:
    out = _core_conditions(f)
    if f.admitted is not None:
        out.append(f.admitted)
        out.append(f.scaling_limited or Condition("ScalingLimited", "False", "NotSized", "nothing to scale yet"))
    if f.routed is not None:
        out.append(f.routed)
    if f.scaled_to_zero is not None:
        out.append(f.scaled_to_zero)
    return out


def _core_conditions(f: Facts) -> list[Condition]:
    c = {}
    if f.spec_error is not None:
        c["Sized"] = Condition("Sized", "Unknown", "InvalidSpec", f.spec_error)
        stalled = ("InvalidSpec", f.spec_error)
    else:
        c["Sized"] = f.sized
        stalled = None
        if f.sized is not None and f.sized.status != "True":
            stalled = (f.sized.reason, f.sized.message)
        elif f.blocker is not None:
            stalled = f.blocker
    r = f.rollout
    if stalled is None and r is not None and r.desired == 0 and f.quota is not None and f.quota.status == "True":
        stalled = ("QuotaExhausted", f.quota.message)
    if stalled is None and r is not None and r.pod_blocked:
        stalled = ("PodsBlocked", r.pod_problem)
    stalled = stalled or f.route_stall
    queued = f.kueue_holding and r is not None and r.ready < r.needed
    if stalled is None and r is not None and r.deadline_exceeded and not queued:
        stalled = ("ProgressDeadlineExceeded", r.deadline_exceeded + (f"; {r.pod_problem}" if r.pod_problem else ""))

    c["QuotaLimited"] = f.quota or Condition("QuotaLimited", "False", "NotChecked", "no replicas to check against the GPU quota")
    c["ScalingActive"] = f.scaling or Condition("ScalingActive", "False", "NotSized", "nothing to scale yet")

    if stalled is not None:
        c["Stalled"] = Condition("Stalled", "True", *stalled)
        c["Reconciling"] = Condition("Reconciling", "False", "Stalled", "waiting for a change that unblocks it")
        c["Ready"] = Condition("Ready", "False", stalled[0], stalled[1])
        return [c[t] for t in CONDITION_TYPES]

    c["Stalled"] = Condition("Stalled", "False", "NotStalled", "nothing blocks progress")
    progress = _progress(r)
    if progress is None and f.routed is not None and f.routed.status != "True":
        progress = (f.routed.reason, f.routed.message)  # the endpoint clients use is not serving yet
    if queued and f.admitted is not None:
        # Waiting in a queue is progress (kstatus InProgress), not a failure: Kueue admits it when GPUs free up.
        progress = ("QueuedByKueue", f"{r.ready}/{r.desired} replicas ready; {f.admitted.message}")
    if progress is not None:
        c["Reconciling"] = Condition("Reconciling", "True", *progress)
        c["Ready"] = Condition("Ready", "False", progress[0], progress[1])
    else:
        c["Reconciling"] = Condition("Reconciling", "False", "Reconciled", "children match the spec")
        if r.desired == 0 and f.scaled_to_zero is not None:
            c["Ready"] = Condition("Ready", "True", "ScaledToZero",
                                   f"0 replicas (idle): requests to {f.endpoint} wait in the router while one starts")
        elif r.desired == 0:
            c["Ready"] = Condition("Ready", "True", "ScaledToZero", "0 replicas requested")
        else:
            scaling = " (scaling up)" if r.ready < r.desired else ""
            c["Ready"] = Condition("Ready", "True", "Available",
                                   f"{r.ready}/{r.desired} replicas ready{scaling} at {f.endpoint}")
    return [c[t] for t in CONDITION_TYPES]


def _progress(r: Rollout | None) -> tuple[str, str] | None:
    """(reason, message) while the Deployment is still moving toward the spec; None when done."""
    if r is None or not r.exists:
        return "Creating", "creating the engine Deployment"
    problem = f"; {r.pod_problem}" if r.pod_problem else ""
    if not r.observed_current or r.replicas > r.updated:
        return "RollingOut", f"{r.updated}/{r.desired} replicas updated, {r.ready} ready{problem}"
    if r.ready < r.needed:
        return "WaitingForReplicas", f"{r.ready}/{r.desired} replicas ready{problem}"
    if r.replicas > r.desired and r.needed == r.desired:
        return "ScalingDown", f"{r.replicas} pods, {r.desired} desired"
    return None
