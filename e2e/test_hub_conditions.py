"""hf:// models against the real API server, with the operator asking the Hub stand-in (its --hf-endpoint):
a model the catalog lacks is sized from the repo's config.json at a pinned revision, and a gated repo
without a token or a missing repo become Stalled conditions naming the repo, with no pods created.

The session's operator is replaced for this module by one with --hf-endpoint (two operators would both
reconcile the objects); it is started again afterwards."""

from __future__ import annotations

import json

import pytest
from cluster import Cluster
from e2e_helpers import (
    ISVC,
    OperatorProcess,
    apply,
    condition,
    get,
    replaced_operator,
    wait_for,
)
from hub_standin import HubStandin

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512,
          "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub") / "repo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    with HubStandin() as hub:
        hub.sha = hub.add_repo("acme/tiny-chat", folder, tags=("v1",))
        hub.add_repo("acme/gated-chat", folder, gated=True, tokens=("hf_granted",))
        yield hub


@pytest.fixture(scope="module")
def hub_operator(cluster: Cluster, operator: OperatorProcess, chart_release: str, hub, tmp_path_factory):
    log = tmp_path_factory.mktemp("op") / "operator.log"
    with replaced_operator(cluster, operator, chart_release, [f"--hf-endpoint={hub.url}"], log) as mine:
        yield mine


def service(name: str, uri: str) -> dict:
    return {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"uri": uri}, "resources": {"gpu": {"type": "nvidia-l4", "count": 1}}, "replicas": 1}}


def test_hub_model_sized_from_config_and_hub_problems_stall(cluster: Cluster, hub_operator: OperatorProcess,
                                                           namespace: str, hub) -> None:
    apply(cluster, service("tiny", "hf://acme/tiny-chat@v1"), namespace)
    apply(cluster, service("gated", "hf://acme/gated-chat"), namespace)
    apply(cluster, service("missing", "hf://acme/missing"), namespace)

    tiny = wait_for(lambda: (o := get(cluster, ISVC, "tiny", namespace)) and condition(o, "Sized") and o,
                    "tiny sized", timeout=90)
    assert condition(tiny, "Sized")["status"] == "True", hub_operator.log_tail()
    hub_status = tiny["status"]["sizing"]["hub"]
    assert tiny["status"]["sizing"]["profileSource"] == "hub"
    assert (hub_status["commit"], hub_status["revision"]) == (hub.sha, "v1")
    assert tiny["status"]["sizing"]["maxModelLen"] == 2048  # config.json's max_position_embeddings
    dep = wait_for(lambda: get(cluster, "deployment", "tiny", namespace), "the Deployment of tiny", timeout=60)
    engine = dep["spec"]["template"]["spec"]["containers"][0]
    assert engine["args"][:2] == ["--model", "hf://acme/tiny-chat@v1"]
    assert {"name": "HF_ENDPOINT", "value": hub.url} in engine["env"]

    for name, reason, words in (("gated", "GatedModel", "hf://acme/gated-chat is gated"),
                                ("missing", "ModelNotFound", "no model repository acme/missing")):
        obj = wait_for(lambda n=name: (o := get(cluster, ISVC, n, namespace)) and condition(o, "Stalled") and o,
                       f"{name} stalled", timeout=90)
        stalled = condition(obj, "Stalled")
        assert (stalled["status"], stalled["reason"]) == ("True", reason), stalled
        assert words in stalled["message"]
        assert condition(obj, "Ready")["status"] == "False"
        assert get(cluster, "deployment", name, namespace) is None
    events = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    assert "GatedModel" in events and "ModelNotFound" in events
