"""Invalid InferenceServices are refused by the API server itself (schema and CEL rules), with the message."""

from __future__ import annotations

import copy

import pytest
from cluster import Cluster
from e2e_helpers import ISVC, apply, get

# The CRD comes from the chart (helm installs crds/ first), as it would for a user.
pytestmark = pytest.mark.usefixtures("chart_release")

VALID = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "chat"},
    "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
             "resources": {"gpu": {"type": "nvidia-l4", "count": 1}}, "replicas": 1},
}


def with_spec(**changes) -> dict:
    obj = copy.deepcopy(VALID)
    for path, value in changes.items():
        node = obj["spec"]
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return obj


CASES = {
    "replicas together with scaling": (
        with_spec(scaling={"minReplicas": 1, "maxReplicas": 3}), "mutually exclusive"),
    "minReplicas above maxReplicas": (
        with_spec(replicas=None, scaling={"minReplicas": 4, "maxReplicas": 2}),
        "minReplicas must be less than or equal to scaling.maxReplicas"),
    "unknown GPU type": (
        with_spec(resources__gpu__type="nvidia-rtx-9090"), 'Unsupported value: "nvidia-rtx-9090"'),
    "negative replicas": (with_spec(replicas=-1), "spec.replicas: Invalid value: -1"),
    "unsupported model scheme": (with_spec(model__uri="s3://bucket/llama"), "model.uri must start with"),
    "unknown bundled model": (
        with_spec(model__uri="bundled://llama-70b"), "the only bundled model is bundled://smollm2-135m-instruct"),
    "maxModelLen neither auto nor positive": (
        with_spec(engine={"maxModelLen": -5}), "maxModelLen must be auto or a positive integer"),
    "GPU memory utilization above 1": (
        with_spec(engine={"gpuMemoryUtilization": 1.5}), "spec.engine.gpuMemoryUtilization"),
    "prometheus metrics without a URL": (
        with_spec(replicas=None, scaling={"minReplicas": 1, "maxReplicas": 2, "metrics": {"source": "prometheus"}}),
        "scaling.metrics.url is required when source is prometheus"),
    "GPU count that is not a power of two": (with_spec(resources__gpu__count=3), "spec.resources.gpu.count"),
}


def test_the_valid_base_manifest_is_accepted(cluster: Cluster, module_namespace: str) -> None:
    """Guards the cases below: each is refused for its one change, not for something in the base."""
    proc = apply(cluster, VALID, module_namespace, check=False)
    assert proc.returncode == 0, proc.stderr
    assert get(cluster, ISVC, "chat", module_namespace) is not None
    cluster.kubectl("delete", ISVC, "chat", "-n", module_namespace)


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_manifest_is_refused_with_the_rule_message(cluster: Cluster, module_namespace: str,
                                                          case: str) -> None:
    manifest, message = CASES[case]
    proc = apply(cluster, manifest, module_namespace, check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert "is invalid" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert get(cluster, ISVC, "chat", module_namespace) is None
