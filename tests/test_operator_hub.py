"""hf:// models in the operator, with the real huggingface_hub client against the Hub stand-in
(tests/hub_standin.py): sizing a model the catalog lacks from its config.json, the conditions for a
gated, missing or unreachable repo, the token Secret, HF_ENDPOINT and the model cache volume."""

import base64
import json
import pathlib
import socket
from importlib import metadata

import numpy as np
import pytest
from hub_standin import HubStandin
from safetensors.numpy import save_file
from test_operator_reconcile import NS, FakeApi, add_isvc, cond
from tokenmill.operator import reconcile as rec
from tokenmill.operator.kube import KubeError
from tokenmill.operator.observe.hub import HubCache, HubError, fetch, weights_bytes

# A Llama-shaped model the catalog does not have; the numbers sizing must come back with.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 6, "hidden_size": 256,
          "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
TENSOR_ELEMENTS = 3000  # the parameter count the stand-in reads from the safetensors header


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("acme") / "tiny-chat"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file({"w": np.zeros((TENSOR_ELEMENTS,), dtype=np.float16)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def hub(model_dir):
    with HubStandin() as hub:
        hub.sha = hub.add_repo("acme/tiny-chat", model_dir, tags=("v1",))
        hub.add_repo("acme/gated-chat", model_dir, gated=True, tokens=("hf_granted",))
        yield hub


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_fetch_reads_commit_weights_parameters_and_config(hub, model_dir, tmp_path):
    m = fetch("acme/tiny-chat", "v1", None, hub.url, with_config=True, cache_dir=str(tmp_path))
    assert m.commit == hub.sha and m.revision == "v1" and m.gated is False
    assert m.weights_bytes == (model_dir / "model.safetensors").stat().st_size
    assert m.parameters == TENSOR_ELEMENTS
    assert m.config["num_hidden_layers"] == 6
    assert hub.downloads("acme/tiny-chat", "model.safetensors") == 0  # sizing never downloads weights
    without = fetch("acme/tiny-chat", None, None, hub.url, with_config=False, cache_dir=str(tmp_path))
    assert without.config is None and without.revision == "main"
    assert hub.downloads("acme/tiny-chat", "config.json") == 1
    # Every request names the operator (API call, HEAD and GET alike), so a Hub's logs tell it from the engines.
    agents = {r.user_agent.split(";")[0] for r in hub.requests("acme/tiny-chat")}
    assert agents == {f"tokenmill-operator/{metadata.version('tokenmill')}"}, agents


@pytest.mark.parametrize(("repo", "revision", "token", "reason", "words"), [
    ("acme/nope", None, None, "ModelNotFound", "no model repository acme/nope"),
    ("acme/tiny-chat", "v9", None, "RevisionNotFound", "revision 'v9' does not exist in acme/tiny-chat"),
    ("acme/gated-chat", None, None, "GatedModel", "hf://acme/gated-chat is gated: create a Secret"),
    ("acme/gated-chat", None, "hf_other", "GatedModel", "has not been granted access"),
])
def test_hub_errors_become_reasons_naming_the_repo(hub, tmp_path, repo, revision, token, reason, words):
    with pytest.raises(HubError) as e:
        fetch(repo, revision, token, hub.url, with_config=False, cache_dir=str(tmp_path))
    assert e.value.reason == reason and words in str(e.value), str(e.value)


def test_granted_token_and_unreachable_hub(hub, tmp_path):
    m = fetch("acme/gated-chat", None, "hf_granted", hub.url, with_config=False, cache_dir=str(tmp_path))
    assert m.gated is True and m.config is None
    with pytest.raises(HubError) as e:
        fetch("acme/tiny-chat", None, None, closed_port_url(), with_config=True, cache_dir=str(tmp_path))
    assert e.value.reason == "HubUnreachable" and "hf://acme/tiny-chat" in str(e.value)


def test_a_cached_gated_config_does_not_stand_in_for_a_token(hub, tmp_path):
    """Once a granted token fetched a gated config.json into the operator's cache, a lookup without a token
    or with another token still asks the Hub, and is refused: the cache proves nothing about this token."""
    granted = fetch("acme/gated-chat", None, "hf_granted", hub.url, with_config=True, cache_dir=str(tmp_path))
    assert granted.config is not None
    for token, words in ((None, "is gated: create a Secret"), ("hf_other", "has not been granted access")):
        with pytest.raises(HubError) as e:
            fetch("acme/gated-chat", None, token, hub.url, with_config=True, cache_dir=str(tmp_path))
        assert e.value.reason == "GatedModel" and words in str(e.value)


def test_weights_counted_once_when_a_consolidated_copy_exists():
    files = [("model-00001-of-00002.safetensors", 10), ("model-00002-of-00002.safetensors", 5),
             ("consolidated.safetensors", 15), ("README.md", 1), ("original/consolidated.00.pth", 99)]
    assert weights_bytes(files) == 15
    assert weights_bytes([("consolidated.safetensors", 15)]) == 15
    assert weights_bytes([("model.bin", 3)]) is None


def test_cache_asks_once_and_retries_errors_later():
    calls, clock = [], [0.0]

    def fetcher(repo, revision, token, endpoint, with_config, cache_dir=None):
        calls.append(repo)
        if repo == "bad/repo":
            raise HubError("ModelNotFound", "no")
        return repo

    cache = HubCache(fetcher=fetcher, clock=lambda: clock[0])
    assert cache.lookup("a/b", None, None, None, True) == cache.lookup("a/b", None, None, None, True) == "a/b"
    for _ in range(2):
        with pytest.raises(HubError):
            cache.lookup("bad/repo", None, None, None, True)
    assert calls == ["a/b", "bad/repo"]
    clock[0] += 120  # past the error retry, within the success lifetime
    with pytest.raises(HubError):
        cache.lookup("bad/repo", None, None, None, True)
    cache.lookup("a/b", None, None, None, True)
    assert calls == ["a/b", "bad/repo", "bad/repo"]


class SecretApi(FakeApi):
    def __init__(self):
        super().__init__()
        self.values: dict[tuple[str, str], str] = {}

    def add_secret(self, name: str, key: str, value: str) -> None:
        self.secrets.setdefault(name, set()).add(key)
        self.values[(name, key)] = base64.b64encode(value.encode()).decode()

    def secret_value(self, ns, name, key):
        raw = self.values.get((name, key))
        return None if raw is None else base64.b64decode(raw).decode()


def reconcile(api, config, name="chat"):
    return rec.reconcile(api, api.get("InferenceService", NS, name), config, autoscale=False, now=1_000_000.0)


def hf_spec(uri: str, **model) -> dict:
    return {"model": {"uri": uri, **model}, "resources": {"gpu": {"type": "nvidia-l4"}}}


def engine(api, name="chat") -> dict:
    return api.objects[("Deployment", NS, name)]["spec"]["template"]["spec"]["containers"][0]


def test_a_model_the_catalog_lacks_is_sized_from_its_hub_config(hub, tmp_path):
    api = SecretApi()
    config = rec.OperatorConfig(hf_endpoint=hub.url, hub=HubCache(cache_dir=str(tmp_path)))
    add_isvc(api, hf_spec("hf://acme/tiny-chat@v1"))
    status = reconcile(api, config)
    sizing = status["sizing"]
    assert cond(status, "Sized")["status"] == "True"
    assert sizing["profileSource"] == "hub"
    assert sizing["hub"]["commit"] == hub.sha and sizing["hub"]["revision"] == "v1"
    assert sizing["hub"]["configFile"] == f"config.json at {hub.sha}"
    assert sizing["hub"]["parametersFrom"] == "safetensors metadata"
    # bf16 weights of the counted parameters; KV per token = 2 x layers x kv heads x head dim x 2 bytes
    assert sizing["weightsBytes"] == TENSOR_ELEMENTS * 2
    assert sizing["kvBytesPerToken"] == 2 * 6 * 2 * (256 // 8) * 2
    assert sizing["maxModelLen"] == 4096
    c = engine(api)
    assert c["args"][:2] == ["--model", "hf://acme/tiny-chat@v1"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_ENDPOINT"] == hub.url and env["HF_HOME"] == "/model-cache/huggingface"
    reconcile(api, config)  # a second pass asks nothing new: the lookup is cached
    assert hub.downloads("acme/tiny-chat", "config.json") == 1
    assert len(hub.requests("acme/tiny-chat", "GET")) == 2  # model_info + config.json, once


@pytest.mark.parametrize(("uri", "reason", "words"), [
    ("hf://acme/gated-chat", "GatedModel", "spec.model.tokenSecretRef"),
    ("hf://acme/missing", "ModelNotFound", "acme/missing"),
    ("hf://acme/tiny-chat@no-such-branch", "RevisionNotFound", "no-such-branch"),
])
def test_hub_problems_are_conditions_and_create_no_pods(hub, tmp_path, uri, reason, words):
    api = SecretApi()
    config = rec.OperatorConfig(hf_endpoint=hub.url, hub=HubCache(cache_dir=str(tmp_path)))
    add_isvc(api, hf_spec(uri))
    status = reconcile(api, config)
    for type_ in ("Sized", "Stalled", "Ready"):
        c = cond(status, type_)
        assert c["reason"] == reason and words in c["message"], c
    assert cond(status, "Stalled")["status"] == "True"
    assert ("Deployment", NS, "chat") not in api.objects
    assert any(e[0] == "Warning" and e[1] == reason for e in api.events)


def test_an_unreachable_hub_is_unknown_for_unsized_models_and_no_blocker_for_catalog_ones(tmp_path):
    config = rec.OperatorConfig(hf_endpoint=closed_port_url(), hub=HubCache(cache_dir=str(tmp_path)))
    api = SecretApi()
    add_isvc(api, hf_spec("hf://acme/tiny-chat"))
    status = reconcile(api, config)
    assert (cond(status, "Sized")["status"], cond(status, "Sized")["reason"]) == ("Unknown", "HubUnreachable")
    assert ("Deployment", NS, "chat") not in api.objects
    add_isvc(api, hf_spec("hf://meta-llama/Llama-3.1-8B-Instruct"), name="known")
    status = reconcile(api, config, name="known")
    assert cond(status, "Sized")["status"] == "True" and status["sizing"]["profileSource"] == "catalog"
    assert ("Deployment", NS, "known") in api.objects  # the engine will try the Hub itself


def test_gated_model_with_a_granted_token_secret(hub, tmp_path):
    api = SecretApi()
    config = rec.OperatorConfig(hf_endpoint=hub.url, hub=HubCache(cache_dir=str(tmp_path)))
    add_isvc(api, hf_spec("hf://acme/gated-chat", tokenSecretRef={"name": "hf"}))
    status = reconcile(api, config)
    stalled = cond(status, "Stalled")
    assert stalled["reason"] == "SecretNotFound" and "Secret hf (spec.model.tokenSecretRef) not found" in stalled["message"]
    api.add_secret("hf", "HF_TOKEN", "hf_granted")
    config.hub = HubCache(cache_dir=str(tmp_path))  # a new operator: nothing cached
    status = reconcile(api, config)
    assert cond(status, "Ready")["reason"] != "GatedModel" and cond(status, "Sized")["status"] == "True"
    assert status["sizing"]["hub"]["gated"] is True
    token = next(e for e in engine(api)["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert "hf_granted" not in json.dumps(status) and all("hf_granted" not in e[2] for e in api.events)


def test_the_cache_claim_is_created_shared_and_removed_with_the_spec(tmp_path):
    config = rec.OperatorConfig(hub=HubCache(fetcher=lambda *a, **k: (_ for _ in ()).throw(
        HubError("HubUnreachable", "offline"))))
    api = SecretApi()
    add_isvc(api, {**hf_spec("hf://meta-llama/Llama-3.1-8B-Instruct", cache={"size": "100Gi",
                                                                             "storageClassName": "rwx"}),
                   "scaling": {"maxReplicas": 3}})
    reconcile(api, config)
    pvc = api.objects[("PersistentVolumeClaim", NS, "chat-model-cache")]
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}},
                           "storageClassName": "rwx"}
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
    vols = api.objects[("Deployment", NS, "chat")]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "chat-model-cache"}} in vols
    assert {"name": "model-cache", "mountPath": "/model-cache"} in engine(api)["volumeMounts"]

    body = api.objects[("InferenceService", NS, "chat")]
    body["spec"]["model"]["cache"] = {"claimName": "team-models"}
    body["metadata"]["generation"] = 2
    reconcile(api, config)
    assert ("PersistentVolumeClaim", NS, "chat-model-cache") not in api.objects  # ours, no longer wanted
    vols = api.objects[("Deployment", NS, "chat")]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "team-models"}} in vols


def test_a_token_the_operator_may_not_read(hub, tmp_path):
    """A Secret the operator may not read (cluster-wide mode, a name outside rbac.secretNames): the pods still get the token, so a
    gated catalog model goes ahead; one that needs config.json says what to grant."""
    api = SecretApi()
    api.secrets_forbidden = True
    api.secret_value = lambda *a: (_ for _ in ()).throw(KubeError(403, "secrets is forbidden"))
    config = rec.OperatorConfig(hf_endpoint=hub.url, hub=HubCache(cache_dir=str(tmp_path)))
    hub.add_repo("meta-llama/Llama-3.1-8B-Instruct", hub.repos["acme/tiny-chat"].commits[hub.sha]["config.json"]
                 .local.parent, gated=True, tokens=("hf_granted",))
    add_isvc(api, hf_spec("hf://meta-llama/Llama-3.1-8B-Instruct", tokenSecretRef={"name": "hf"}), name="known")
    status = reconcile(api, config, name="known")
    assert cond(status, "Sized")["status"] == "True" and ("Deployment", NS, "known") in api.objects
    add_isvc(api, hf_spec("hf://acme/gated-chat", tokenSecretRef={"name": "hf"}))
    sized = cond(reconcile(api, config), "Sized")
    assert sized["reason"] == "GatedModel" and "may not read Secret hf" in sized["message"]
    assert "add hf to the chart value rbac.secretNames" in sized["message"]
