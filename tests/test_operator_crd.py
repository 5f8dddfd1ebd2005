"""The CRD files: structural schema, descriptions, defaults and enums tied to the Python code.

The API server's own validation of these rules (CEL included) runs in the e2e suite; here we check
what can drift: the GPU enum against the catalog, defaults against spec.DEFAULTS, and that every
field the parser reads exists in the schema.
"""

import pathlib
import re

import pytest
import yaml
from tokenmill.operator.plan.catalog import GPU_TYPES, find_model_profile
from tokenmill.operator.plan.sizing import valid_tensor_parallel_sizes
from tokenmill.operator.plan.spec import (
    BUNDLED_MODELS,
    DEFAULTS,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    SpecError,
    parse_inference_service,
)

CRDS = pathlib.Path(__file__).resolve().parent.parent / "crds"


def load(name: str) -> dict:
    return yaml.safe_load((CRDS / name).read_text())


@pytest.fixture(scope="module")
def crd() -> dict:
    return load(f"{PLURAL}.{GROUP}.yaml")


@pytest.fixture(scope="module")
def version(crd) -> dict:
    (v,) = crd["spec"]["versions"]
    return v


@pytest.fixture(scope="module")
def spec_schema(version) -> dict:
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_one_file_per_crd_and_names():
    files = sorted(p.name for p in CRDS.glob("*.yaml"))
    assert files == ["clusterkopfpeerings.kopf.dev.yaml", f"{PLURAL}.{GROUP}.yaml", "kopfpeerings.kopf.dev.yaml"]
    for f in files:
        doc = load(f)
        assert doc["kind"] == "CustomResourceDefinition"
        assert doc["metadata"]["name"] == f.removesuffix(".yaml")
        assert doc["metadata"]["name"] == f"{doc['spec']['names']['plural']}.{doc['spec']['group']}"


def test_group_version_kind(crd, version):
    assert crd["spec"]["group"] == GROUP and crd["spec"]["names"]["kind"] == KIND
    assert crd["spec"]["scope"] == "Namespaced"
    assert version["name"] == VERSION and version["served"] and version["storage"]


def test_gpu_type_enum_is_the_catalog(spec_schema):
    gpu = spec_schema["properties"]["resources"]["properties"]["gpu"]["properties"]
    assert gpu["type"]["enum"] == list(GPU_TYPES)
    # Any count of one node's GPUs: the largest node in the catalog bounds it; sizing checks the model.
    assert "enum" not in gpu["count"]
    assert (gpu["count"]["minimum"], gpu["count"]["maximum"]) == (1, max(g.gpus_per_node for g in GPU_TYPES.values()))


def test_bundled_model_gpu_count_rule_is_the_sizing_rule(spec_schema):
    """The CEL rule that refuses a gpu.count the bundled model's heads cannot split lists exactly the counts
    sizing (and so the engine's parallel_check) accepts, and its message names the model's numbers. (A
    messageExpression naming the count was refused by the API server: its estimated cost, string(int), is
    over the budget.)"""
    [rule] = [r for r in spec_schema["x-kubernetes-validations"] if "resources.gpu.count" in r["rule"]]
    profile = find_model_profile(f"bundled://{BUNDLED_MODELS[0]}")
    valid = valid_tensor_parallel_sizes(profile, spec_schema["properties"]["resources"]["properties"]["gpu"][
        "properties"]["count"]["maximum"])
    assert valid == [1, 3]
    listed = re.search(r"self\.resources\.gpu\.count in \[([0-9, ]+)\]", rule["rule"]).group(1)
    assert [int(x) for x in listed.split(",")] == valid
    assert f"'bundled://{BUNDLED_MODELS[0]}'" in rule["rule"] and len(BUNDLED_MODELS) == 1
    numbers = (f"{profile.num_attention_heads} attention heads, {profile.num_key_value_heads} KV heads, "
               f"MLP width {profile.intermediate_size}")
    assert rule["message"].startswith("gpu.count must be 1 or 3 for") and numbers in rule["message"]
    assert rule["fieldPath"] == ".resources.gpu.count"


@pytest.mark.parametrize("name", ["inferenceservices.serving.tokenmill.dev.yaml", "kopfpeerings.kopf.dev.yaml",
                                  "clusterkopfpeerings.kopf.dev.yaml"])
def test_every_field_has_a_description_and_a_structural_type(name):
    doc = load(name)
    for v in doc["spec"]["versions"]:
        for path, node in walk(v["schema"]["openAPIV3Schema"]):
            if path.endswith("{}"):
                assert node == {"type": "string"}, path
                continue
            if path == ".metadata":  # the API server forbids anything but the type here
                assert node == {"type": "object"}
                continue
            assert node.get("description"), f"{name}: {path or '<root>'} has no description"
            typed = "type" in node or node.get("x-kubernetes-int-or-string")
            assert typed, f"{path} has no type (structural schemas need one)"
            if node.get("x-kubernetes-int-or-string"):
                assert "type" not in node, path


def test_defaults_match_the_parser(spec_schema):
    for dotted, value in DEFAULTS.items():
        node = spec_schema
        for part in dotted.split("."):
            node = node["properties"][part]
        assert node.get("default") == value, dotted


def rules(node: dict) -> list[str]:
    return [r["rule"] for r in node.get("x-kubernetes-validations") or []]


def test_cel_rules_for_cross_field_checks(version, spec_schema):
    root = version["schema"]["openAPIV3Schema"]
    assert any("self.metadata.name" in r for r in rules(root))
    assert "!(has(self.replicas) && has(self.scaling))" in rules(spec_schema)
    scaling = spec_schema["properties"]["scaling"]
    assert "self.minReplicas <= self.maxReplicas" in rules(scaling)
    assert any("prometheus" in r for r in rules(scaling["properties"]["metrics"]))
    model = spec_schema["properties"]["model"]["properties"]
    assert any("bundled|pvc|hf|file" in r for r in rules(model["uri"]))
    for path, node in walk(spec_schema):
        for rule in node.get("x-kubernetes-validations") or []:
            assert rule.get("message"), f"{path}: CEL rule without a message"
        if node.get("x-kubernetes-int-or-string") and path.endswith(("maxModelLen", "maxNumSeqs", "targetQueueDepth")):
            assert "type(self) == string ? self == 'auto' : self >= 1" in rules(node), path


def test_numbers_cannot_be_negative(spec_schema):
    for path, node in walk(spec_schema):
        if node.get("type") == "integer" and "enum" not in node:
            assert node.get("minimum") is not None, f"{path} accepts negative numbers"
        if node.get("type") == "number":
            assert node.get("minimum") == 0 and node.get("exclusiveMinimum") is True, path
    for q in ("cpu", "memory"):
        node = spec_schema["properties"]["resources"]["properties"][q]
        assert not node["pattern"].startswith("^(\\+|-)"), "a sign in the quantity pattern admits negatives"


def test_subresources_and_printer_columns(version):
    sub = version["subresources"]
    assert sub["status"] == {}
    assert sub["scale"] == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector"}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["GPUs/Replica"] == ".status.sizing.gpusPerReplica"
    assert columns["KV-Tokens"] == ".status.sizing.kvTokens"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert {"Model", "Ready-Replicas", "Desired", "Age"} <= set(columns)


def test_status_schema_has_what_the_operator_writes(version):
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    from tokenmill.operator.plan.catalog import MODEL_PROFILES
    from tokenmill.operator.plan.sizing import plan
    from tokenmill.operator.status import plan_status

    p = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-l4"])
    assert set(plan_status(p, MODEL_PROFILES["SmolLM2-135M"])) <= set(status["sizing"]["properties"])
    for key in ("observedGeneration", "conditions", "replicas", "readyReplicas", "desiredReplicas", "selector",
                "endpoint", "scaling", "kopf"):
        assert key in status


def full_object() -> dict:
    """A manifest that sets every field of the schema (an example for users, too)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1", "generation": 3},
        "spec": {
            "model": {"uri": "hf://acme/my-llama@v2", "name": "my-llama",
                      "tokenSecretRef": {"name": "hf-token", "key": "HF_TOKEN"},
                      "cache": {"size": "200Gi", "storageClassName": "fast-rwx", "accessMode": "ReadWriteMany"},
                      "lora": {"adapters": [{"name": "sql", "uri": "hf://acme/sql-lora@v1"}], "maxRank": 32,
                               "maxAdapters": 2},
                      "profile": {"base": "Llama-3.1-8B", "parameters": 8_030_261_248, "layers": 32, "hiddenSize": 4096,
                                  "intermediateSize": 14336, "numAttentionHeads": 32, "numKeyValueHeads": 8,
                                  "headDim": 128, "vocabSize": 128256, "maxPositionEmbeddings": 131072,
                                  "tieWordEmbeddings": False}},
            "engine": {"dtype": "bfloat16", "kvCacheDtype": "int8", "blockSize": 16, "maxModelLen": 8192, "maxNumSeqs": "auto",
                       "gpuMemoryUtilization": 0.85, "enablePrefixCaching": False, "maxWaitingRequests": 64,
                       "startupTimeoutSeconds": 1200},
            "resources": {"gpu": {"type": "nvidia-l4", "count": 1}, "cpu": "8", "memory": "40Gi"},
            "scaling": {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 6, "scaleUpStabilizationSeconds": 30,
                        "scaleDownStabilizationSeconds": 600, "idleSeconds": 900,
                        "metrics": {"source": "prometheus", "url": "http://prometheus.monitoring:9090",
                                    "query": "sum(vllm:num_requests_waiting{namespace=\"$namespace\"})"}},
            "template": {"image": "registry.example/tokenmill:1", "imagePullPolicy": "IfNotPresent",
                         "imagePullSecrets": [{"name": "regcred"}], "nodeSelector": {"pool": "gpu"},
                         "tolerations": [{"key": "dedicated", "operator": "Exists"}], "affinity": {},
                         "priorityClassName": "inference", "serviceAccountName": "engine", "runtimeClassName": "nvidia",
                         "annotations": {"a": "b"}, "labels": {"team": "a"}, "env": [{"name": "X", "value": "1"}]},
            "apiKeySecretRef": {"name": "chat-keys", "key": "api-key"},
            "routing": {"enabled": True, "gateway": {"name": "inference-gateway", "namespace": "gateways"}},
        },
    }


def test_every_schema_field_is_read_by_the_parser(spec_schema):
    obj = full_object()
    schema_paths = {p for p, _ in walk(spec_schema) if p}
    set_paths = set()

    def collect(value, path=""):
        if isinstance(value, dict) and path not in (".template.affinity", ".template.nodeSelector",
                                                    ".template.annotations", ".template.labels"):
            for k, v in value.items():
                collect(v, f"{path}.{k}")
        elif isinstance(value, list):
            for item in value:
                collect(item, f"{path}[]")
        set_paths.add(path)

    collect(obj["spec"])
    set_paths.discard("")
    leaves = {p for p, n in walk(spec_schema) if p and not n.get("properties") and not p.endswith("{}")}
    # replicas is exclusive with scaling: parsed in test_operator_reconcile's fixed-size objects
    # and cache.claimName with cache.size: parsed below
    missing = {p for p in leaves if p not in set_paths and p not in (".replicas", ".model.cache.claimName")}
    assert not missing, f"the example omits {missing}"
    assert set_paths <= schema_paths | {".template.tolerations[].key", ".template.tolerations[].operator",
                                        ".template.env[].value"}
    spec = parse_inference_service(obj)
    assert spec.scaling.prometheus_query and spec.engine.max_model_len == 8192 and spec.gpu_count == 1
    assert spec.token_secret == ("hf-token", "HF_TOKEN") and spec.cache.storage_class == "fast-rwx"
    assert spec.routing.gateway_name == "inference-gateway" and spec.routing.gateway_namespace == "gateways"
    assert spec.scaling.idle_seconds == 900 and spec.engine.kv_cache_dtype == "int8"
    assert spec.lora.adapters[0].uri == "hf://acme/sql-lora@v1" and (spec.lora.max_rank, spec.lora.max_adapters) == (32, 2)
    obj["spec"]["model"]["cache"] = {"claimName": "shared-models"}
    assert parse_inference_service(obj).cache.claim_name == "shared-models"


def test_kv_cache_dtype_enum_is_the_engines_and_its_rule_is_the_parsers(spec_schema):
    """The CRD's kvCacheDtype values are the engine's --kv-cache-dtype choices; a 16/32-bit cache that is not
    the model's dtype is refused by the CEL rule (API server) and the parser alike, with the way out."""
    from tokenmill.engine.kv_memory import KV_CACHE_DTYPES

    engine = spec_schema["properties"]["engine"]
    assert engine["properties"]["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    [rule] = [r for r in engine["x-kubernetes-validations"] if "kvCacheDtype" in r["rule"]]
    assert "use auto, int8, fp8" in rule["message"]
    obj = full_object()
    for dtype, kv, ok in (("bfloat16", "bfloat16", True), ("auto", "bfloat16", True), ("float32", "float32", True),
                          ("auto", "fp8", True), ("float32", "int8", True), ("float32", "bfloat16", False),
                          ("auto", "float16", False)):
        obj["spec"]["engine"].update(dtype=dtype, kvCacheDtype=kv)
        if ok:
            assert parse_inference_service(obj).engine.kv_cache_dtype == kv
        else:
            with pytest.raises(SpecError, match=r"spec\.engine\.kvCacheDtype: .*use auto, or an 8-bit cache"):
                parse_inference_service(obj)


def test_parser_takes_any_count_of_one_node_and_refuses_more():
    obj = full_object()
    obj["spec"]["resources"]["gpu"]["count"] = 3  # not a power of two: the model decides (sizing)
    assert parse_inference_service(obj).gpu_count == 3
    for bad, words in ((9, "must be 1 to 8 (the GPUs of one node), got 9"), (0, "must be at least 1, got 0")):
        obj["spec"]["resources"]["gpu"]["count"] = bad
        with pytest.raises(SpecError, match=re.escape(f"spec.resources.gpu.count {words}")):
            parse_inference_service(obj)


def test_peering_crds_match_kopf():
    import kopf._cogs.structs.references as refs

    cluster, ns = load("clusterkopfpeerings.kopf.dev.yaml"), load("kopfpeerings.kopf.dev.yaml")
    assert (cluster["spec"]["scope"], ns["spec"]["scope"]) == ("Cluster", "Namespaced")
    assert refs.CLUSTER_PEERINGS_K.any_name == cluster["spec"]["names"]["plural"]
    assert refs.NAMESPACED_PEERINGS_K.any_name == ns["spec"]["names"]["plural"]
    assert refs.CLUSTER_PEERINGS_K.group == "kopf.dev" == cluster["spec"]["group"]
    assert cluster["spec"]["versions"][0]["name"] == refs.CLUSTER_PEERINGS_K.version


def test_scale_to_zero_needs_routing_in_the_crd_and_the_parser(spec_schema):
    from tokenmill.operator.plan.spec import SCALE_TO_ZERO_NEEDS_ROUTING

    (rule,) = [r for r in spec_schema["x-kubernetes-validations"] if "minReplicas" in r["rule"]]
    assert rule["message"] == SCALE_TO_ZERO_NEEDS_ROUTING and rule["fieldPath"] == ".scaling.minReplicas"
    assert spec_schema["properties"]["scaling"]["properties"]["minReplicas"]["minimum"] == 0
    obj = full_object()
    obj["spec"]["scaling"]["minReplicas"] = 0
    assert parse_inference_service(obj).scaling.min_replicas == 0
    del obj["spec"]["routing"]
    with pytest.raises(SpecError, match=re.escape(SCALE_TO_ZERO_NEEDS_ROUTING)):
        parse_inference_service(obj)
    obj["spec"]["routing"] = {"enabled": False}
    with pytest.raises(SpecError, match=re.escape("needs spec.routing.enabled: true")):
        parse_inference_service(obj)
    obj["spec"]["scaling"]["minReplicas"] = 1
    assert parse_inference_service(obj).routing is None  # routing off: no router
    obj["spec"]["routing"] = {"enabled": True}
    routing = parse_inference_service(obj).routing
    assert routing is not None and routing.gateway_name is None  # standalone Envoy
