"""One reconcile of one InferenceService, in its stages: observe (the Hub, the children and pods, the
engines' metrics, the GPU quota) -> plan (pure: the sizing plan, the replica count) -> desired children
(pure, one module per kind) -> apply -> status. Each stage is a call below, in that order; the work is in
the stage modules (tokenmill.operator's docstring has the map).

`api` is a KubeApi or anything with the same methods (tests use a dict-backed fake). Kopf never appears
here; handlers.py calls `reconcile` from watch events and from the per-object loop.
"""

import dataclasses
import threading
import time
from dataclasses import dataclass, field

from tokenmill.operator.apply import apply_children
from tokenmill.operator.children.desired import desired_children
from tokenmill.operator.children.leaderworkerset import lws_name
from tokenmill.operator.children.pod import DEFAULT_ENGINE_IMAGE
from tokenmill.operator.children.router import RouterSettings
from tokenmill.operator.observe.cluster import first_blocker, read_children
from tokenmill.operator.observe.engine_metrics import Readings, query_prometheus, read_engines, scrape_pods
from tokenmill.operator.observe.hub import HubCache
from tokenmill.operator.observe.hub_lookup import ask_hub
from tokenmill.operator.observe.kueue import read_queue
from tokenmill.operator.observe.router_metrics import read_router_queue
from tokenmill.operator.plan.autoscaler import STALE_AFTER_SECONDS
from tokenmill.operator.plan.kueue import (
    admission,
    effective_queue_labels,
    refused_edit,
    workload_name_pattern,
)
from tokenmill.operator.plan.profiles import hub_question, size_service
from tokenmill.operator.plan.replicas import plan_replicas
from tokenmill.operator.plan.sizing import gpus_per_replica
from tokenmill.operator.plan.spec import SpecError, parse_inference_service
from tokenmill.operator.status import (
    held,
    invalid,
    lora_status,
    measurement,
    own_status,
    recommendations,
    serving,
    write_status,
    zero_state,
)


@dataclass(slots=True)
class OperatorConfig:
    engine_image: str = DEFAULT_ENGINE_IMAGE
    interval: float = 15.0  # seconds between autoscaling / drift passes per object
    metrics_timeout: float = 2.0
    stale_after: float = STALE_AFTER_SECONDS
    hf_endpoint: str | None = None  # HF_ENDPOINT for the engine pods and the operator's hub lookups
    hub: HubCache = field(default_factory=HubCache)
    router: RouterSettings = field(default_factory=RouterSettings)  # images and ClusterRole of routers


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
    scrape: Readings = scrape_pods,
    query_prometheus: Readings = query_prometheus,
    read_held=read_router_queue,
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
        return _reconcile(api, fresh, config, autoscale, time.time() if now is None else now, scrape, query_prometheus,
                          read_held)


def _reconcile(api, body: dict, config: OperatorConfig, autoscale: bool, now: float, scrape: Readings,
               query_prometheus: Readings, read_held) -> dict:
    previous = own_status(body)
    try:
        spec = parse_inference_service(body)
    except SpecError as e:
        return write_status(api, body, previous, invalid(body, str(e)), now)

    # Observe the Hub (hf:// models) and plan the size; observe the children, the pods, what blocks.
    sized = size_service(spec, ask_hub(api, spec, config.hub, config.hf_endpoint, hub_question(spec)))
    live = read_children(api, spec, sized.plan, previous)
    blocker = first_blocker(api, spec, sized.plan, live) if sized.feasible else None
    # Kueue's labels: an edit its webhook would refuse is refused here, with the reason; a label dropped
    # from the InferenceService stays on the workload (Kueue refuses removing it).
    raw_workload = live.objects.get(live.workload_kind) if live.workload is not None else None
    blocker = blocker or refused_edit(spec, raw_workload, live.workload_kind)
    queue, priority = effective_queue_labels(spec, raw_workload)
    spec = dataclasses.replace(spec, queue_name=queue, priority_class=priority)
    if blocker is not None or not sized.feasible:
        return write_status(api, body, previous, held(spec, sized, live, previous, blocker, now), now)

    # Observe the engines, the GPU quota and Kueue's queue; plan the replicas.
    view = read_queue(api, spec.namespace, spec.queue_name, live)
    queued = None if view is None else admission(spec, view, live.pods, gpus_per_replica(sized.plan),
                                                 workload_name_pattern(spec, lws_name(spec)), now)
    engines = read_engines(spec, live.pods, autoscale, config.metrics_timeout, scrape, query_prometheus)
    if spec.routing is not None and spec.scaling is not None and autoscale:
        held_requests, why = read_held(spec.name, live.router.pods, config.metrics_timeout)
        engines = dataclasses.replace(engines, router_queue=held_requests, router_error=why)
    measured, events = measurement(previous, sized.plan, spec.generation, engines.measured, now)
    replicas = plan_replicas(spec, sized.plan, current=live.current, engines=engines, measured=measured,
                             previous=previous, history=recommendations(previous),
                             quotas=api.list("ResourceQuota", spec.namespace), pods=live.pods,
                             interval=config.interval, stale_after=config.stale_after, autoscale=autoscale, now=now,
                             queue=queued, zero_state=zero_state(previous))

    # The desired children, applied; then status.
    desired = desired_children(spec, sized.plan, replicas.replicas, config.engine_image, config.hf_endpoint,
                               config.router)
    applied = apply_children(api, spec, desired, live, replicas.why, events)
    report = serving(spec, sized, live, previous, replicas, applied, measured, events, now, queued)
    lora = lora_status(spec, engines, previous)
    if lora is not None:
        report.status["lora"] = lora
    return write_status(api, body, previous, report, now)
