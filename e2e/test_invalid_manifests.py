"""Invalid InferenceServices are refused by the API server itself (schema and CEL rules), with the message."""

from __future__ import annotations

import copy

import pytest
from cluster import Cluster
from e2e_helpers import ISVC, OperatorProcess, apply, condition, get, wait_for

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
    # The bundled model's shape is known at admission: its 9 heads split only by 1 or 3 (CEL).
    "GPU count that does not split the bundled model's heads": (
        with_spec(resources__gpu__count=2),
        "spec.resources.gpu.count: Invalid value: gpu.count must be 1 or 3 for bundled://smollm2-135m-instruct "
        "(9 attention heads, 3 KV heads, MLP width 1536; each tensor parallel rank needs whole heads)"),
    "GPU count beyond one node": (
        with_spec(resources__gpu__count=16), "spec.resources.gpu.count in body should be less than or equal to 8"),
    "scale to zero without routing": (
        with_spec(replicas=None, scaling={"minReplicas": 0, "maxReplicas": 2}),
        "spec.scaling.minReplicas: Invalid value: scaling.minReplicas 0 (scale to zero) needs "
        "spec.routing.enabled: true"),
    "scale to zero with routing off": (
        with_spec(replicas=None, scaling={"minReplicas": 0, "maxReplicas": 2}, routing={"enabled": False}),
        "scaling.minReplicas 0 (scale to zero) needs spec.routing.enabled: true"),
    "GPU count of zero": (
        with_spec(resources__gpu__count=0), "spec.resources.gpu.count in body should be greater than or equal to 1"),
}


def test_the_valid_base_manifest_is_accepted(cluster: Cluster, module_namespace: str) -> None:
    """Guards the cases below: each is refused for its one change, not for something in the base."""
    proc = apply(cluster, VALID, module_namespace, check=False)
    assert proc.returncode == 0, proc.stderr
    assert get(cluster, ISVC, "chat", module_namespace) is not None
    cluster.kubectl("delete", ISVC, "chat", "-n", module_namespace)


@pytest.mark.parametrize(("uri", "count"), [("bundled://smollm2-135m-instruct", 3), ("hf://acme/chat", 3)])
def test_gpu_counts_that_are_not_powers_of_two_are_accepted(cluster: Cluster, module_namespace: str, uri: str,
                                                             count: int) -> None:
    """3 splits the bundled model's 9 heads; for a model the CRD cannot see, sizing decides (below)."""
    proc = apply(cluster, with_spec(model__uri=uri, resources__gpu__count=count), module_namespace, check=False)
    assert proc.returncode == 0, proc.stderr
    cluster.kubectl("delete", ISVC, "chat", "-n", module_namespace)


def test_gpu_count_the_model_cannot_split_is_a_condition_naming_the_numbers(
        cluster: Cluster, operator: OperatorProcess, namespace: str) -> None:
    """Llama-3.1-8B (a catalog model: 32 attention heads, baked into the image at a path) at gpu.count 3: admitted, then Sized=False and
    Stalled=True with reason InvalidGPUCount, the heads and the counts that work, and no Deployment."""
    apply(cluster, with_spec(model__uri="file:///models/Llama-3.1-8B-Instruct", resources__gpu__count=3), namespace)
    obj = wait_for(lambda: (o := get(cluster, ISVC, "chat", namespace))
                   and (condition(o, "Stalled") or {}).get("status") == "True" and o, "Stalled with the sizing reason",
                   timeout=60)
    sized = condition(obj, "Sized")
    assert (sized["status"], sized["reason"]) == ("False", "InvalidGPUCount"), sized
    assert "gpu.count 3 cannot split Llama-3.1-8B evenly (32 attention heads, 8 KV heads, MLP width 14336" in \
        sized["message"] and sized["message"].endswith("use 1, 2, 4 or 8"), sized["message"]
    assert condition(obj, "Stalled")["reason"] == "InvalidGPUCount"
    assert get(cluster, "deployment", "chat", namespace) is None


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_manifest_is_refused_with_the_rule_message(cluster: Cluster, module_namespace: str,
                                                          case: str) -> None:
    manifest, message = CASES[case]
    proc = apply(cluster, manifest, module_namespace, check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert "is invalid" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert get(cluster, ISVC, "chat", module_namespace) is None
