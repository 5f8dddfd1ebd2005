"""The CRD's rules for model sources (hf:// uris, the model cache, the token Secret), as the API server
itself applies them: valid manifests are accepted, invalid ones refused with the rule's message."""

from __future__ import annotations

import copy

import pytest
from cluster import Cluster
from e2e_helpers import ISVC, apply, get

pytestmark = pytest.mark.usefixtures("chart_release")  # the CRD as helm installs it

BASE = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "hub"},
    "spec": {"model": {"uri": "hf://acme/tiny-chat"}, "resources": {"gpu": {"type": "nvidia-l4", "count": 1}},
             # replicas 0: the API server's validation is under test, not the operator's pods
             "replicas": 0},
}


def with_model(**model) -> dict:
    obj = copy.deepcopy(BASE)
    obj["spec"]["model"] = model
    return obj


VALID = {
    "revision tag": with_model(uri="hf://acme/tiny-chat@v1.0"),
    "commit and a token": with_model(uri="hf://acme/tiny-chat@" + "a" * 40, tokenSecretRef={"name": "hf"}),
    "cache by size": with_model(uri="hf://acme/tiny-chat", cache={"size": "100Gi", "storageClassName": "rwx",
                                                                   "accessMode": "ReadWriteMany"}),
    "cache by claim": with_model(uri="hf://acme/tiny-chat", cache={"claimName": "team-models"}),
}

INVALID = {
    "hf uri without an org": (with_model(uri="hf://tiny-chat"), "an hf model.uri is hf://ORG/NAME"),
    "hf uri with an empty revision": (with_model(uri="hf://acme/tiny-chat@"), "an hf model.uri is hf://ORG/NAME"),
    "relative file uri": (with_model(uri="file://models/x"), "a file model.uri is file:///ABSOLUTE/PATH"),
    "cache on a pvc model": (with_model(uri="pvc://models/x", cache={"size": "1Gi"}),
                             "model.cache holds Hugging Face downloads: it applies to hf:// uris only"),
    "token on a bundled model": (with_model(uri="bundled://smollm2-135m-instruct", tokenSecretRef={"name": "x"}),
                                 "model.tokenSecretRef is the Hugging Face token of an hf:// model"),
    "cache with claim and size": (with_model(uri="hf://acme/m", cache={"claimName": "c", "size": "1Gi"}),
                                  "model.cache takes claimName (an existing PersistentVolumeClaim) or size"),
    "empty cache": (with_model(uri="hf://acme/m", cache={}), "not both and not neither"),
    "class with a named claim": (with_model(uri="hf://acme/m", cache={"claimName": "c", "storageClassName": "x"}),
                                 "they go with size, not claimName"),
    "size that is no quantity": (with_model(uri="hf://acme/m", cache={"size": "lots"}), "spec.model.cache.size"),
    "unknown access mode": (with_model(uri="hf://acme/m", cache={"size": "1Gi", "accessMode": "ReadMany"}),
                            'Unsupported value: "ReadMany"'),
}


@pytest.mark.parametrize("case", list(VALID))
def test_model_source_manifest_is_accepted(cluster: Cluster, module_namespace: str, case: str) -> None:
    proc = apply(cluster, VALID[case], module_namespace, check=False)
    assert proc.returncode == 0, f"{case}: {proc.stderr}"
    obj = get(cluster, ISVC, "hub", module_namespace)
    if "tokenSecretRef" in VALID[case]["spec"]["model"]:
        assert obj["spec"]["model"]["tokenSecretRef"]["key"] == "HF_TOKEN"  # the schema default
    cluster.kubectl("delete", ISVC, "hub", "-n", module_namespace)


@pytest.mark.parametrize("case", list(INVALID))
def test_model_source_manifest_is_refused_with_the_rule_message(cluster: Cluster, module_namespace: str,
                                                                case: str) -> None:
    manifest, message = INVALID[case]
    proc = apply(cluster, manifest, module_namespace, check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert message in proc.stderr, proc.stderr
    assert get(cluster, ISVC, "hub", module_namespace) is None
