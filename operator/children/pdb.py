"""The PodDisruptionBudget of a service that may run more than one replica: one pod down at a time."""

from tokenmill.operator.children.meta import child_metadata, selector_labels, stamp
from tokenmill.operator.plan.spec import ServiceSpec


def wants_pdb(spec: ServiceSpec) -> bool:
    """A PDB when the service may run more than one replica. Decided from the spec, not the current
    count, so autoscaling does not create and delete it back and forth."""
    if spec.scaling is not None:
        return spec.scaling.max_replicas > 1
    return (spec.replicas or 0) > 1


def desired_pdb(spec: ServiceSpec) -> dict | None:
    if not wants_pdb(spec):
        return None
    return stamp({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(spec),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # Let drains evict pods that are not serving anyway (crash-looping, still loading).
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    })

