"""Kopf wiring: the only module that imports kopf. Handlers are thin; reconcile.py does the work.

- InferenceService watch events reconcile an object when it is new (or listed at startup) or its
  generation is ahead of status.observedGeneration.
- A per-object loop (our own asyncio task, started from the watch events) runs the autoscaler and
  corrects drift every `interval` seconds, pausing with Kopf's peering (leadership.py).
- Deployment and LeaderWorkerSet watch events (ours only, by label) reconcile the owner, so status
  follows rollouts and a hand-edited child is put back at once.

Kopf writes nothing to our objects: there are no changing handlers (so no progress or diff-base
annotations) and no daemons or timers (Kopf puts a finalizer on every object that has one, which would
block deleting an InferenceService whenever the operator is down). Only Kopf's public decorators are
used. What little Kopf could store goes to status.kopf.
"""

import asyncio
import datetime
import logging
import os

import kopf
from tokenmill.operator import reconcile as rec
from tokenmill.operator.children.meta import MANAGED_BY, OPERATOR_NAME
from tokenmill.operator.kube import KubeApi
from tokenmill.operator.leadership import acting
from tokenmill.operator.plan.scale_to_zero import WAKE_POLL_SECONDS
from tokenmill.operator.plan.spec import GROUP, KIND, PLURAL, VERSION
from tokenmill.operator.self_metrics import RECONCILE_SECONDS, RECONCILES

log = logging.getLogger("tokenmill.operator")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    # No runtime watching of namespaces and CRDs: that needs cluster-wide RBAC on both. Resources are
    # discovered once at startup, so the CRDs must be installed first (checked below).
    settings.scanning.disabled = True
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.diffbase")
    settings.posting.enabled = False  # we post our own events, one per decision
    settings.watching.server_timeout = 300  # re-list now and then: a lost watch event heals itself
    settings.execution.max_workers = 32
    if getattr(memo, "api", None) is None:
        memo.api = KubeApi()
    if getattr(memo, "config", None) is None:
        memo.config = rec.OperatorConfig()
    if getattr(memo, "loops", None) is None:
        memo.loops = {}  # (namespace, name) -> (uid, asyncio task)
    try:
        installed = memo.api.has_resource(GROUP, VERSION, PLURAL)
    except Exception as e:
        raise kopf.TemporaryError(f"cannot reach the API server: {e}", delay=10) from e
    if not installed:
        raise kopf.PermanentError(
            f"the CRD {PLURAL}.{GROUP} ({VERSION}) is not installed: kubectl apply -f crds/ (or install the "
            "Helm chart), then start the operator"
        )


@kopf.on.login()
def login(**kwargs) -> kopf.ConnectionInfo | None:
    """Same precedence as our own client: $KUBECONFIG, else the in-cluster ServiceAccount."""
    if os.environ.get("KUBECONFIG"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _needs_reconcile(event_type: str | None, body: kopf.Body) -> bool:
    if event_type in (None, "ADDED"):
        return True
    generation = body.get("metadata", {}).get("generation")
    return generation != (body.get("status") or {}).get("observedGeneration")


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_service_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    meta = body.get("metadata", {})
    if event.get("type") == "DELETED":
        rec.forget(meta.get("namespace", ""), meta.get("name", ""))
        return
    if _needs_reconcile(event.get("type"), body):
        _safe_reconcile(memo, dict(body), autoscale=False)


# LeaderWorkerSets too (multi-node replicas), when their CRD is installed before the operator starts
# (resources are resolved once; without it Kopf logs them as unresolved and the per-object loop still
# follows their status every interval).
@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY: OPERATOR_NAME})
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels={MANAGED_BY: OPERATOR_NAME})
def on_deployment_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    meta = body.get("metadata", {})
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND), None)
    if owner is None:
        return
    service = memo.api.get("InferenceService", meta.get("namespace"), owner["name"])
    if service is not None and service["metadata"].get("uid") == owner.get("uid"):
        _safe_reconcile(memo, service, autoscale=False)


@kopf.on.event(GROUP, VERSION, PLURAL, id="loops")
async def track_loops(event: dict, name: str, namespace: str, uid: str, memo: kopf.Memo, **_) -> None:
    """One loop per live InferenceService: started by its first event (only an acting replica gets
    events), stopped by its deletion or by the loop itself when the object is gone."""
    key = (namespace, name)
    known = memo.loops.get(key)
    if event.get("type") == "DELETED":
        if known is not None and known[0] == uid:
            known[1].cancel()
            memo.loops.pop(key, None)
        return
    if known is not None and known[0] == uid and not known[1].done():
        return
    if known is not None:
        known[1].cancel()  # a new object under the same name
    memo.loops[key] = (uid, asyncio.create_task(keep_serving(memo, namespace, name, uid),
                                                name=f"tokenmill loop {namespace}/{name}"))


@kopf.on.cleanup()
async def stop_loops(memo: kopf.Memo, **_) -> None:
    for _uid, task in list((getattr(memo, "loops", None) or {}).values()):
        task.cancel()


def _acting(memo: kopf.Memo, namespace: str) -> bool:
    """Standalone: always. Peered: by the peering object's heartbeats (leadership.py); unreadable
    counts as not acting, so two replicas never both scale."""
    peering = getattr(memo, "peering", None)
    if peering is None:
        return True
    name, priority, clusterwide = peering
    try:
        obj = (memo.api.get("ClusterKopfPeering", None, name) if clusterwide
               else memo.api.get("KopfPeering", namespace, name))
    except Exception as e:
        log.warning("cannot read the peering object %s: %s; pausing this pass", name, e)
        return False
    return acting((obj or {}).get("status"), priority, datetime.datetime.now(datetime.UTC))


async def keep_serving(memo: kopf.Memo, namespace: str, name: str, uid: str) -> None:
    """Autoscaling and drift correction every `interval` seconds, for as long as the object exists."""
    interval = memo.config.interval
    delay = interval
    try:
        while True:
            await asyncio.sleep(delay)
            if not await asyncio.to_thread(_acting, memo, namespace):
                continue  # a standby: the acting replica does this pass
            try:
                body = await asyncio.to_thread(memo.api.get, "InferenceService", namespace, name)
            except Exception as e:
                log.warning("cannot read InferenceService %s/%s: %s", namespace, name, e)
                continue
            if body is None or body["metadata"].get("uid") != uid:
                return  # deleted (or replaced by a new object with its own loop)
            status = await asyncio.to_thread(_safe_reconcile, memo, body, True)
            delay = min(interval, WAKE_POLL_SECONDS) if at_zero(status) else interval
    finally:
        known = memo.loops.get((namespace, name))
        if known is not None and known[0] == uid and known[1] is asyncio.current_task():
            memo.loops.pop((namespace, name), None)


def at_zero(status: dict | None) -> bool:
    """A service scaled to zero: its loop reads the router's queue every WAKE_POLL_SECONDS, so that a held
    request wakes it at once."""
    status = status or {}
    return status.get("desiredReplicas") == 0 and any(
        c.get("type") == "ScaledToZero" for c in status.get("conditions") or [])


def _safe_reconcile(memo: kopf.Memo, body: dict, autoscale: bool) -> dict:
    """A failure on one object is logged and retried on the next event or tick; others go on. Returns the
    status written ({} on failure)."""
    meta = body.get("metadata", {})
    try:
        with RECONCILE_SECONDS.time():
            status = rec.reconcile(memo.api, body, memo.config, autoscale=autoscale)
        RECONCILES.labels(result="ok").inc()
        return status
    except Exception:
        RECONCILES.labels(result="error").inc()
        log.exception("reconcile of InferenceService %s/%s failed; retrying in %ss",
                      meta.get("namespace"), meta.get("name"), memo.config.interval)
        return {}


def run(
    config: rec.OperatorConfig,
    namespaces: list[str],
    peering: str | None = None,
    priority: int | None = None,
    liveness: str | None = None,
) -> None:
    """Run the operator until SIGTERM/SIGINT: all namespaces when `namespaces` is empty; with
    `peering`, only the highest-priority live replica acts."""
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=peering is None,
        peering_name=peering,
        priority=priority,
        liveness_endpoint=liveness,
        memo=kopf.Memo(config=config, loops={},
                       peering=None if peering is None else (peering, priority or 0, not namespaces)),
    )
