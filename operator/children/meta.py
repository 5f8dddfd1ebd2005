"""What every child of an InferenceService carries: the engine's HTTP port, labels and selector, the
owner reference, and the hash of the desired object (so that the next apply removes a field we dropped)."""

import hashlib
import json

from tokenmill.operator.plan.spec import API_VERSION, KIND, PRIORITY_LABEL, QUEUE_LABEL, ServiceSpec

PORT = 8000
OPERATOR_NAME = "tokenmill-operator"
SERVICE_LABEL = "serving.tokenmill.dev/inferenceservice"
DESIRED_HASH = "serving.tokenmill.dev/desired-hash"
MANAGED_BY = "app.kubernetes.io/managed-by"


def selector_labels(name: str) -> dict[str, str]:
    return {SERVICE_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/name": "tokenmill-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        MANAGED_BY: OPERATOR_NAME,
    }


def kueue_labels(spec: ServiceSpec) -> dict[str, str]:
    """Kueue's queue and priority labels of the InferenceService, for the workload's own metadata (where
    Kueue's Deployment and LeaderWorkerSet integrations read them) and its pod templates (where its pod
    webhook reads them; Kueue's own webhook copies them there too, with the same values)."""
    out = {}
    if spec.queue_name:
        out[QUEUE_LABEL] = spec.queue_name
    if spec.priority_class:
        out[PRIORITY_LABEL] = spec.priority_class
    return out


def workload_metadata(spec: ServiceSpec) -> dict:
    """child_metadata with Kueue's labels: for the Deployment or LeaderWorkerSet only."""
    meta = child_metadata(spec)
    return {**meta, "labels": {**meta["labels"], **kueue_labels(spec)}}


def owner_reference(spec: ServiceSpec) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(spec: ServiceSpec) -> dict:
    """Name, namespace, labels and the owner reference every child carries."""
    return {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": labels(spec.name),
        "ownerReferences": [owner_reference(spec)],
    }


def is_owned_by(obj: dict, spec: ServiceSpec) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == spec.uid and r.get("kind") == KIND for r in refs)


def stamp(obj: dict) -> dict:
    """Record a hash of the desired object on it: when our own desired state drops a field, the hash
    changes and the next apply removes the field (a field-by-field comparison cannot see a removal)."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    obj["metadata"]["annotations"] = {**obj["metadata"].get("annotations", {}), DESIRED_HASH: digest}
    return obj

