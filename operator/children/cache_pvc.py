"""The model cache PersistentVolumeClaim the operator creates for hf:// downloads from
spec.model.cache.size, shared by every pod of the service (model_source.py mounts it)."""

from tokenmill.operator.children.meta import child_metadata
from tokenmill.operator.children.model_source import cache_claim_name
from tokenmill.operator.plan.spec import ServiceSpec


def cache_access_mode(spec: ServiceSpec, max_replicas: int) -> str:
    """ReadWriteMany when pods on several nodes may share the cache; one replica can do with RWO."""
    if spec.cache is not None and spec.cache.access_mode:
        return spec.cache.access_mode
    return "ReadWriteMany" if max_replicas > 1 else "ReadWriteOnce"


def desired_cache_claim(spec: ServiceSpec) -> dict | None:
    """The PVC the operator creates from spec.model.cache.size (None when the user names one or there
    is no cache). It carries the owner reference: deleting the InferenceService deletes the cache."""
    if spec.cache is None or spec.cache.size is None:
        return None
    max_replicas = spec.scaling.max_replicas if spec.scaling is not None else (spec.replicas or 0)
    claim_spec = {
        "accessModes": [cache_access_mode(spec, max_replicas)],
        "resources": {"requests": {"storage": spec.cache.size}},
    }
    if spec.cache.storage_class:
        claim_spec["storageClassName"] = spec.cache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {**child_metadata(spec), "name": cache_claim_name(spec)},
        "spec": claim_spec,
    }
