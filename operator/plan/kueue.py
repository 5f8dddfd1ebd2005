"""Kueue admission of an InferenceService's pods, decided from what observe/kueue.py reads: whether Kueue
holds them (and why, with the ClusterQueue's numbers), whether a queue edit can be applied, and how many
replicas the autoscaler may ask of the ClusterQueue. Pure: plain dicts in, conditions and numbers out.

How Kueue v0.19 handles our workloads (e2e/test_kueue_controller.py shows it with the real controller):
its Deployment integration marks the pod template; its pod integration gates every pod with
`kueue.x-k8s.io/admission` and makes one Workload per pod, owned by the pod; a LeaderWorkerSet gets one
Workload per group, owned by the LeaderWorkerSet and its pods, admitted whole. A preempted Deployment pod
is deleted with its Workload (the Deployment makes a gated replacement); the Workload's `Preempted` Event
remains, and its message names the preemptor Workload's UID.
"""

import dataclasses
import datetime
import re
from dataclasses import dataclass, field

from tokenmill.operator.plan.catalog import GPU_RESOURCE
from tokenmill.operator.plan.conditions import Condition, gated
from tokenmill.operator.plan.quota import parse_quantity
from tokenmill.operator.plan.spec import KUEUE_GATE, PRIORITY_LABEL, QUEUE_LABEL, ServiceSpec

API_GROUP, API_VERSION = "kueue.x-k8s.io", "v1beta2"
GATE = KUEUE_GATE
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
# Conditions a queued service has beside conditions.CONDITION_TYPES (only with the queue label).
KUEUE_CONDITION_TYPES = ("Admitted", "ScalingLimited")
# Preempted Events are kept by the API server for its --event-ttl (1 h by default): one that old is history.
PREEMPTION_MEMORY_SECONDS = 3600


@dataclass(frozen=True, slots=True)
class QueueView:
    """What observe/kueue.py read for one queued service."""

    queue: str  # the LocalQueue named by the label
    installed: bool = True  # the API server serves kueue.x-k8s.io
    error: str | None = None  # a read that failed (RBAC): nothing below is known
    local_queue: dict | None = None
    cluster_queue: dict | None = None
    workloads: list[dict] = field(default_factory=list)  # Kueue Workloads owned by our pods or workload
    events: list[dict] = field(default_factory=list)  # the namespace's `Preempted` Events on Workloads

    @property
    def cluster_queue_name(self) -> str | None:
        return ((self.local_queue or {}).get("spec") or {}).get("clusterQueue")


# ---------------------------------------------------------------- the ClusterQueue's GPU numbers

@dataclass(frozen=True, slots=True)
class QueueQuota:
    name: str
    covered: bool  # nvidia.com/gpu is in one of its resourceGroups
    nominal: int  # nvidia.com/gpu nominalQuota summed over its flavors
    borrowing_limit: int | None  # summed; None: no limit set (in a cohort, it may borrow all that is unused)
    cohort: str | None
    used: int  # status.flavorsUsage total of nvidia.com/gpu (admitted workloads, borrowed included)

    @property
    def free(self) -> int:
        return max(0, self.nominal - self.used)

    def describe(self) -> str:
        if not self.covered:
            return f"ClusterQueue {self.name} does not cover {GPU_RESOURCE} in its resourceGroups"
        text = f"ClusterQueue {self.name} has {self.free} of {self.nominal} {GPU_RESOURCE} free ({self.used} in use"
        if self.cohort:
            limit = "no limit" if self.borrowing_limit is None else f"up to {self.borrowing_limit}"
            text += f"; borrows {limit} from cohort {self.cohort}"
        return text + ")"


def queue_quota(cq: dict) -> QueueQuota:
    spec, status = cq.get("spec") or {}, cq.get("status") or {}
    covered, nominal, limits = False, 0, []
    for group in spec.get("resourceGroups") or []:
        if GPU_RESOURCE not in (group.get("coveredResources") or []):
            continue
        covered = True
        for flavor in group.get("flavors") or []:
            for r in flavor.get("resources") or []:
                if r.get("name") == GPU_RESOURCE:
                    nominal += int(parse_quantity(r.get("nominalQuota", 0)))
                    limits.append(r.get("borrowingLimit"))
    used = 0
    for flavor in status.get("flavorsUsage") or []:
        for r in flavor.get("resources") or []:
            if r.get("name") == GPU_RESOURCE:
                used += int(parse_quantity(r.get("total", 0)))
    cohort = spec.get("cohortName") or spec.get("cohort")
    borrowing = None
    if not cohort:
        borrowing = 0  # outside a cohort there is nothing to borrow
    elif limits and all(x is not None for x in limits):
        borrowing = sum(int(parse_quantity(x)) for x in limits)
    return QueueQuota((cq.get("metadata") or {}).get("name", "?"), covered, nominal, borrowing, cohort, used)


# ---------------------------------------------------------------- admission

@dataclass(frozen=True, slots=True)
class Admission:
    """Kueue's view of this service's replicas (a replica is a pod, or a LeaderWorkerSet group)."""

    admitted: Condition  # the Admitted condition
    queued: int = 0  # replicas Kueue holds
    admitted_replicas: int = 0
    own_gpus: int = 0  # GPUs of the admitted replicas (what this service uses of the ClusterQueue)
    quota: QueueQuota | None = None

    @property
    def holding(self) -> bool:
        return self.queued > 0


def replicas_of(pods: list[dict]) -> dict[str, list[dict]]:
    """Pods by replica: a LeaderWorkerSet group's pods together, a Deployment's pods one by one."""
    out: dict[str, list[dict]] = {}
    for p in pods:
        labels = (p.get("metadata") or {}).get("labels") or {}
        key = f"group {labels[GROUP_INDEX_LABEL]}" if GROUP_INDEX_LABEL in labels else p["metadata"]["name"]
        out.setdefault(key, []).append(p)
    return out


def _time(event: dict) -> float | None:
    for text in ((event.get("series") or {}).get("lastObservedTime"), event.get("lastTimestamp"),
                 event.get("eventTime"), (event.get("metadata") or {}).get("creationTimestamp")):
        if text:
            try:
                return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def workload_name_pattern(spec: ServiceSpec, lws_name: str) -> re.Pattern:
    """Names Kueue gives the Workloads of our pods (`pod-<pod>-<hash>`, the pod being `<name>-<rs>-<id>`)
    and of our groups (`leaderworkerset-<lws>-<index>-<hash>`): how a Preempted Event on a Workload
    that is gone with its pod is known as ours."""
    name, lws = re.escape(spec.name), re.escape(lws_name)
    return re.compile(rf"^(pod-{name}-[a-z0-9]+-[a-z0-9]+-[a-z0-9]+|leaderworkerset-{lws}-[0-9]+-[a-z0-9]+)$")


def preemptions(view: QueueView, pattern: re.Pattern, now: float) -> tuple[list[dict], list[dict]]:
    """(recent Preempted Events of our Workloads, recent ones whose preemptor is one of our Workloads)."""
    ours_uids = {(w.get("metadata") or {}).get("uid") for w in view.workloads} - {None}
    victims, by_us = [], []
    for e in view.events:
        if e.get("reason") != "Preempted":
            continue
        t = _time(e)
        if t is not None and now - t > PREEMPTION_MEMORY_SECONDS:
            continue
        if pattern.match((e.get("involvedObject") or {}).get("name") or ""):
            victims.append(e)
        elif any(f"(UID: {uid}," in (e.get("message") or "") for uid in ours_uids):
            by_us.append(e)
    return victims, by_us


def _why_pending(view: QueueView) -> str:
    """Kueue's own words for the first pending Workload: its QuotaReserved (or Evicted) message."""
    for w in sorted(view.workloads, key=lambda w: w["metadata"].get("name", "")):
        conds = {c.get("type"): c for c in (w.get("status") or {}).get("conditions") or []}
        if (conds.get("Admitted") or {}).get("status") == "True":
            continue
        for kind in ("Evicted", "QuotaReserved"):
            c = conds.get(kind)
            if c and c.get("message") and (kind != "Evicted" or c.get("status") == "True"):
                return f"; Kueue: {c['message']}"
    return ""


def admission(spec: ServiceSpec, view: QueueView, pods: list[dict], gpus_per_replica: int, pattern: re.Pattern,
              now: float) -> Admission:
    q = view.queue
    if not view.installed:
        return Admission(Condition("Admitted", "Unknown", "KueueNotInstalled",
                                   f"the label {QUEUE_LABEL}={q} is set but the API server does not serve "
                                   f"{API_GROUP}/{API_VERSION}: install Kueue, or remove the label"))
    if view.error is not None:
        return Admission(Condition("Admitted", "Unknown", "KueueUnreadable",
                                   f"cannot read Kueue's LocalQueue {q}, ClusterQueue or Workloads: {view.error} "
                                   "(the chart grants it with rbac.kueue)"))
    replicas = replicas_of(pods)
    queued = [k for k, ps in replicas.items() if any(gated(p) for p in ps)]
    admitted = len(replicas) - len(queued)
    own = admitted * gpus_per_replica
    quota = queue_quota(view.cluster_queue) if view.cluster_queue is not None else None
    if quota is not None and quota.used < own:
        # Kueue updates the ClusterQueue's flavorsUsage after it admits (seen: "0 in use" with both of this
        # service's pods admitted and Ready); what this service's admitted replicas hold is a floor for it.
        quota = dataclasses.replace(quota, used=own)
    unit = "groups" if any(k.startswith("group ") for k in replicas) else "pods"
    cq = view.cluster_queue_name
    victims, by_us = preemptions(view, pattern, now)
    if view.local_queue is None:
        cond = Condition("Admitted", "False", "LocalQueueNotFound",
                         f"LocalQueue {q} does not exist in namespace {spec.namespace}: Kueue holds the "
                         f"{len(queued)} {unit} until it does")
    elif queued:
        waiting = len(queued) * gpus_per_replica
        where = f"LocalQueue {q} -> ClusterQueue {cq}"
        numbers = quota.describe() if quota is not None else f"ClusterQueue {cq} not found"
        text = (f"Kueue holds {len(queued)} of {len(replicas)} {unit} ({GATE} gate) in {where}: they ask for "
                f"{waiting} {GPU_RESOURCE} ({gpus_per_replica} per replica); {numbers}{_why_pending(view)}")
        if victims:
            newest = max(victims, key=lambda e: _time(e) or 0)
            text = f"preempted: {newest.get('message', '')}; {text}"
            cond = Condition("Admitted", "False", "Preempted", text)
        elif any((c.get("type"), c.get("status")) == ("Evicted", "True")
                 for w in view.workloads for c in (w.get("status") or {}).get("conditions") or []):
            cond = Condition("Admitted", "False", "Evicted", text)
        else:
            cond = Condition("Admitted", "False", "QueuedByKueue", text)
    elif replicas:
        text = f"{admitted} {unit} admitted by ClusterQueue {cq} ({own} {GPU_RESOURCE})"
        if quota is not None:
            text += f"; {quota.describe()}"
        if by_us:
            names = ", ".join(sorted({(e.get("involvedObject") or {}).get("name", "?") for e in by_us}))
            text += f"; admitted by preempting {names}"
        cond = Condition("Admitted", "True", "Admitted", text)
    else:
        cond = Condition("Admitted", "False", "NoPods", f"no pods (yet) to admit in LocalQueue {q} -> ClusterQueue {cq}")
    return Admission(cond, len(queued), admitted, own, quota)


# ---------------------------------------------------------------- queue edits Kueue refuses

def effective_queue_labels(spec: ServiceSpec, workload: dict | None) -> tuple[str | None, str | None]:
    """(queue, priority class) the workload keeps. Kueue's webhooks refuse removing either label from a
    workload (always), so a label dropped from the InferenceService stays on the workload it is on."""
    live = ((workload or {}).get("metadata") or {}).get("labels") or {}
    return spec.queue_name or live.get(QUEUE_LABEL) or None, spec.priority_class or live.get(PRIORITY_LABEL) or None


def refused_edit(spec: ServiceSpec, workload: dict | None, kind: str) -> tuple[str, str] | None:
    """(reason, message) when applying the InferenceService's Kueue labels would be refused by Kueue's
    webhook: it forbids changing the queue, or adding a priority class, while any replica is ready."""
    if workload is None:
        return None
    meta, status = workload.get("metadata") or {}, workload.get("status") or {}
    live = meta.get("labels") or {}
    ready = int(status.get("readyReplicas") or 0)
    if ready == 0:
        return None  # suspended in Kueue's eyes: the edit is allowed
    old_q = live.get(QUEUE_LABEL)
    if spec.queue_name and spec.queue_name != old_q:
        was = f"in LocalQueue {old_q}" if old_q else "outside Kueue"
        return ("QueueChangeRefused",
                f"{QUEUE_LABEL}={spec.queue_name} cannot be applied: {kind} {meta.get('name')} runs {was} with "
                f"{ready} ready replicas, and Kueue does not move an admitted workload to another queue; set the "
                f"label back{f' to {old_q}' if old_q else ''}, or scale the service to 0 (or recreate it) to requeue it")
    if spec.priority_class and not live.get(PRIORITY_LABEL):
        return ("QueueChangeRefused",
                f"{PRIORITY_LABEL}={spec.priority_class} cannot be applied: {kind} {meta.get('name')} runs with "
                f"{ready} ready replicas and no priority class, and Kueue adds none to a running workload; remove "
                "the label, or scale the service to 0 (or recreate it)")
    return None


# ---------------------------------------------------------------- the autoscaler's bound

@dataclass(frozen=True, slots=True)
class QueueCap:
    max_replicas: int | None  # None: the ClusterQueue sets no bound we can compute (it borrows without limit)
    message: str


def queue_cap(quota: QueueQuota, own_gpus: int, gpus_per_replica: int) -> QueueCap:
    """Replicas the ClusterQueue can admit for this service: nominal quota plus borrowing limit, less what
    other workloads hold now (what this service's admitted replicas hold is its own)."""
    if not quota.covered:
        return QueueCap(0, quota.describe())
    if quota.borrowing_limit is None:
        return QueueCap(None, f"ClusterQueue {quota.name} ({quota.nominal} {GPU_RESOURCE} nominal) may borrow "
                              f"without limit from cohort {quota.cohort}: no bound is computed")
    limit = quota.nominal + quota.borrowing_limit
    others = max(0, quota.used - own_gpus)
    fits = max(0, limit - others) // max(1, gpus_per_replica)
    return QueueCap(fits, f"ClusterQueue {quota.name} admits {fits} replicas x {gpus_per_replica} {GPU_RESOURCE} "
                          f"(nominal {quota.nominal} + borrowing limit {quota.borrowing_limit}, {others} used by "
                          "other workloads)")
