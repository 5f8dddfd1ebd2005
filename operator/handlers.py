"""Kopf wiring: the only module that imports kopf. Handlers are thin; reconcile.py does the work.

- InferenceService watch events reconcile an object when it is new (or listed at startup) or its
  generation is ahead of status.observedGeneration.
- A per-object loop (a Kopf daemon) runs the autoscaler and corrects drift every `interval` seconds.
- Deployment watch events (ours only, by label) reconcile the owner, so status follows rollouts and
  a hand-edited Deployment is put back at once.

Kopf writes nothing to our objects: there are no changing handlers (so no progress or diff-base
annotations) and the daemon does not ask for a finalizer, so deleting an InferenceService is never
blocked by an operator that is down. What little Kopf could store goes to status.kopf.
"""

import asyncio
import dataclasses
import logging
import os

import kopf
from tokenmill.operator import reconcile as rec
from tokenmill.operator.children import MANAGED_BY, OPERATOR_NAME
from tokenmill.operator.kube import KubeApi
from tokenmill.operator.operator_metrics import RECONCILE_SECONDS, RECONCILES
from tokenmill.operator.spec import GROUP, KIND, PLURAL, VERSION

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


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY: OPERATOR_NAME})
def on_deployment_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    meta = body.get("metadata", {})
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND), None)
    if owner is None:
        return
    service = memo.api.get("InferenceService", meta.get("namespace"), owner["name"])
    if service is not None and service["metadata"].get("uid") == owner.get("uid"):
        _safe_reconcile(memo, service, autoscale=False)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def keep_serving(stopped: kopf.DaemonStopped, name: str, namespace: str, uid: str, memo: kopf.Memo, **_) -> None:
    """Autoscaling and drift correction every `interval` seconds, for as long as the object exists."""
    interval = memo.config.interval
    while not stopped:
        await stopped.wait(interval)
        if stopped:
            return
        try:
            body = await asyncio.to_thread(memo.api.get, "InferenceService", namespace, name)
        except Exception as e:
            log.warning("cannot read InferenceService %s/%s: %s", namespace, name, e)
            continue
        if body is None or body["metadata"].get("uid") != uid:
            return  # deleted (or replaced by a new object with its own loop)
        await asyncio.to_thread(_safe_reconcile, memo, body, True)


def _safe_reconcile(memo: kopf.Memo, body: dict, autoscale: bool) -> None:
    """A failure on one object is logged and retried on the next event or tick; others go on."""
    meta = body.get("metadata", {})
    try:
        with RECONCILE_SECONDS.time():
            rec.reconcile(memo.api, body, memo.config, autoscale=autoscale)
        RECONCILES.labels(result="ok").inc()
    except Exception:
        RECONCILES.labels(result="error").inc()
        log.exception("reconcile of InferenceService %s/%s failed; retrying in %ss",
                      meta.get("namespace"), meta.get("name"), memo.config.interval)


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
        memo=kopf.Memo(config=config),
    )


def _drop_finalizer_requirement(registry: kopf.OperatorRegistry) -> None:
    """Kopf asks for a finalizer on objects with daemons so it can stop them on deletion. Ours stops
    by itself when the object is gone, and a finalizer would block deletion whenever the operator is
    down (stuck namespaces after an uninstall), so the requirement is dropped."""
    spawning = registry._spawning
    spawning._handlers[:] = [dataclasses.replace(h, requires_finalizer=False) for h in spawning._handlers]


_drop_finalizer_requirement(kopf.get_default_registry())
