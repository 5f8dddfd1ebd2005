import copy

import pytest
from tokenmill.operator.apply import differs
from tokenmill.operator.children.deployment import desired_deployment
from tokenmill.operator.children.pdb import desired_pdb
from tokenmill.operator.children.pod import engine_args
from tokenmill.operator.children.service import desired_service, endpoint
from tokenmill.operator.plan.catalog import GPU_TYPES, MODEL_PROFILES
from tokenmill.operator.plan.sizing import plan
from tokenmill.operator.plan.spec import SpecError, parse_inference_service
from tokenmill.operator.plan.startup import startup_timeout_seconds


def isvc(spec: dict, name: str = "chat") -> dict:
    return {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1", "generation": 1}, "spec": spec}


def smol(**extra) -> dict:
    return {"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpu": {"type": "nvidia-l4"}}, **extra}


def build(spec_dict: dict, replicas: int = 1):
    spec = parse_inference_service(isvc(spec_dict))
    from tokenmill.operator.plan.profiles import resolve_profile

    p = plan(resolve_profile(spec), GPU_TYPES[spec.gpu_type], spec.engine, spec.gpu_count)
    return spec, p, desired_deployment(spec, p, replicas, "img:1")


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_bundled_model_args_are_the_sized_numbers():
    _spec, _p, dep = build(smol())
    # SmolLM2 on one L4 (tests/test_operator_sizing.py): 51,467 blocks x 16 tokens x 23,040 bytes
    assert container(dep)["command"] == ["tokenmill", "serve"]
    assert container(dep)["args"] == [
        "--model", "bundled://smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "chat", "--max-model-len", "8192",
        "--max-num-seqs", "256", "--block-size", "16", "--kv-cache-memory", str(51_467 * 16 * 23_040),
        "--dtype", "bfloat16", "--max-waiting-requests", "256", "--shutdown-grace-period", "110",
    ]
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 110
    # An 8-bit cache: the resolved dtype, and the memory for the blocks sized at its bytes (96,880 x 12,240)
    args = container(build(smol(engine={"kvCacheDtype": "fp8"}))[2])["args"]
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert args[args.index("--kv-cache-memory") + 1] == str(96_880 * 16 * 12_240)


def test_gpu_limits_node_selection_and_tolerations():
    _spec, p, dep = build({"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
                          "resources": {"gpu": {"type": "nvidia-h100-80gb"}}}, replicas=3)
    assert p.gpus_per_replica == 2
    c = container(dep)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" == c["resources"]["requests"]["nvidia.com/gpu"]
    assert ["--tensor-parallel-size", "2"] == c["args"][-2:]
    assert c["args"][:2] == ["--model", "hf://meta-llama/Llama-3.1-70B-Instruct"]  # the engine fetches it
    pod = dep["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.product", "operator": "In",
                                         "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"]}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert dep["spec"]["replicas"] == 3


def test_user_affinity_terms_each_get_the_gpu_requirement():
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}},
        "podAntiAffinity": {"x": 1}}
    _spec, _, dep = build(smol(template={"affinity": user, "nodeSelector": {"pool": "gpu"},
                                        "tolerations": [{"key": "t", "operator": "Exists"}]}))
    aff = dep["spec"]["template"]["spec"]["affinity"]
    terms = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]
    assert all(t["matchExpressions"][1]["key"] == "nvidia.com/gpu.product" for t in terms)
    assert aff["podAntiAffinity"] == {"x": 1}
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert {"key": "t", "operator": "Exists"} in dep["spec"]["template"]["spec"]["tolerations"]
    # the user's dict was not modified in place
    assert len(user["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
               ["matchExpressions"]) == 1


def test_probes_use_health_and_the_startup_budget_covers_loading():
    spec, p, dep = build({"model": {"uri": "hf://meta-llama/Llama-3.1-8B"}, "resources": {"gpu": {"type": "nvidia-l4"}}})
    c = container(dep)
    for probe in ("readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    # 600 s + 16,060,522,496 bytes read at 100 MB/s (161 s) + downloaded at 50 MB/s (322 s); every 2 s
    assert startup_timeout_seconds(spec, p) == 1083
    assert c["startupProbe"]["periodSeconds"] == 2
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1083
    assert c["startupProbe"]["failureThreshold"] == 542
    assert dep["spec"]["progressDeadlineSeconds"] > 1083  # a slow load is not a failed rollout
    pvc_spec, pvc_plan, _ = build({"model": {"uri": "pvc://m/llama-3.1-8b"}, "resources": {"gpu": {"type": "nvidia-l4"}}})
    assert startup_timeout_seconds(pvc_spec, pvc_plan) == 761  # nothing to download
    _spec2, _p2, dep2 = build(smol(engine={"startupTimeoutSeconds": 120}))
    assert container(dep2)["startupProbe"]["failureThreshold"] == 60


def test_restricted_security_context():
    _, _, dep = build(smol())
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(dep)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    # Pod Security "restricted" admits only these volume types
    assert all(set(v) - {"name"} <= {"emptyDir", "persistentVolumeClaim"} for v in pod["volumes"])
    # writable places for caches despite the read-only root filesystem
    mounts = {m["mountPath"] for m in container(dep)["volumeMounts"]}
    assert {"/cache", "/model-cache", "/tmp", "/dev/shm"} <= mounts


def test_owner_references_and_labels_on_every_child():
    spec, _, dep = build(smol(replicas=2))
    for obj in (dep, desired_service(spec), desired_pdb(spec)):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService", "name": "chat",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tokenmill-operator"
        assert obj["metadata"]["namespace"] == "team-a"
    sel = {"serving.tokenmill.dev/inferenceservice": "chat"}
    assert dep["spec"]["selector"]["matchLabels"] == sel
    assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_service_port_and_endpoint():
    spec, _, _ = build(smol())
    svc = desired_service(spec)
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                     "appProtocol": "http"}]
    assert svc["spec"]["selector"] == {"serving.tokenmill.dev/inferenceservice": "chat"}
    assert endpoint(spec) == "http://chat.team-a.svc:8000/v1"


@pytest.mark.parametrize(("extra", "wanted"), [
    ({}, False), ({"replicas": 1}, False), ({"replicas": 2}, True), ({"replicas": 0}, False),
    ({"scaling": {"maxReplicas": 1}}, False), ({"scaling": {"minReplicas": 1, "maxReplicas": 3}}, True),
])
def test_pdb_only_when_more_than_one_replica_is_possible(extra, wanted):
    spec = parse_inference_service(isvc(smol(**extra)))
    pdb = desired_pdb(spec)
    assert (pdb is not None) == wanted
    if pdb:
        assert pdb["spec"]["maxUnavailable"] == 1


def test_pvc_model_is_mounted_read_only():
    _, _, dep = build({"model": {"uri": "pvc://models/llama-3.1-8b-instruct/"}, "resources": {"gpu": {"type": "nvidia-a100-80gb"}}})
    c = container(dep)
    assert c["args"][:2] == ["--model", "pvc://models/llama-3.1-8b-instruct/"]  # the engine reads /models/CLAIM/PATH
    assert {"name": "model", "mountPath": "/models/models", "readOnly": True} in c["volumeMounts"]
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_api_key_comes_from_the_secret_and_user_env_is_added():
    _, _, dep = build(smol(apiKeySecretRef={"name": "chat-keys"},
                           template={"env": [{"name": "HF_TOKEN", "value": "x"}, {"name": "HOME", "value": "/evil"}]}))
    env = container(dep)["env"]
    assert {"name": "TOKENMILL_API_KEY", "valueFrom": {"secretKeyRef": {"name": "chat-keys", "key": "api-key"}}} in env
    assert {"name": "HF_TOKEN", "value": "x"} in env
    assert [e["value"] for e in env if e["name"] == "HOME"] == ["/cache"]  # ours win


def test_template_overrides():
    _, _, dep = build(smol(template={"image": "mine:2", "priorityClassName": "high", "runtimeClassName": "nvidia",
                                     "labels": {"team": "a", "serving.tokenmill.dev/inferenceservice": "hijack"},
                                     "annotations": {"x": "y"}, "imagePullSecrets": [{"name": "r"}]}))
    pod = dep["spec"]["template"]
    assert container(dep)["image"] == "mine:2"
    assert pod["spec"]["priorityClassName"] == "high" and pod["spec"]["runtimeClassName"] == "nvidia"
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["labels"]["serving.tokenmill.dev/inferenceservice"] == "chat"
    assert pod["metadata"]["annotations"]["x"] == "y" and pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "r"}]
    _, _, plain = build(smol())
    assert container(plain)["image"] == "img:1"


def test_prefix_caching_off_and_explicit_numbers():
    spec, p, _ = build(smol(engine={"enablePrefixCaching": False, "maxModelLen": 4096, "maxNumSeqs": 32,
                                    "maxWaitingRequests": 8, "dtype": "float16", "blockSize": 32}))
    args = engine_args(spec, p)
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--max-model-len"] == "4096" and pairs["--max-num-seqs"] == "32"
    assert pairs["--dtype"] == "float16" and pairs["--block-size"] == "32" and pairs["--max-waiting-requests"] == "8"
    assert args[-1] == "--no-enable-prefix-caching"


def test_args_parse_with_the_real_server_parser():
    from tokenmill.engine.cli.serve import build_parser

    _spec, p, dep = build(smol(engine={"enablePrefixCaching": False, "maxNumSeqs": 32},
                              apiKeySecretRef={"name": "k"}))
    ns = build_parser().parse_args(container(dep)["args"])
    assert (ns.model, ns.host, ns.port, ns.served_model_name) == ("bundled://smollm2-135m-instruct", "0.0.0.0", 8000,
                                                                  ["chat"])
    assert (ns.max_model_len, ns.max_num_seqs, ns.block_size, ns.dtype) == (8192, 32, 16, "bfloat16")
    assert ns.kv_cache_memory == p.kv_cache_bytes and ns.num_kv_blocks is None
    assert ns.enable_prefix_caching is False and ns.max_waiting_requests == 256
    _, _, hf = build({"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "resources": {"gpu": {"type": "nvidia-h100-80gb"}}})
    assert build_parser().parse_args(container(hf)["args"]).model == "hf://meta-llama/Llama-3.1-8B-Instruct"


def test_no_surge_rollouts():
    _, _, dep = build(smol(replicas=4), replicas=4)
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_differs_ignores_server_defaults_but_sees_our_fields():
    _, _, dep = build(smol())
    live = copy.deepcopy(dep)
    live["metadata"]["resourceVersion"] = "7"
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 1}
    assert not differs(dep, live)
    live["spec"]["replicas"] = 5
    assert differs(dep, live)
    live = copy.deepcopy(dep)
    live["spec"]["template"]["spec"]["containers"][0]["args"].append("--extra")
    assert differs(dep, live)


@pytest.mark.parametrize(("spec", "message"), [
    (smol(replicas=2, scaling={"maxReplicas": 3}), "mutually exclusive"),
    (smol(scaling={"minReplicas": 4, "maxReplicas": 3}), "minReplicas 4 is greater than maxReplicas 3"),
    ({"model": {"uri": "s3://b/m"}, "resources": {"gpu": {"type": "nvidia-l4"}}}, "must start with one of"),
    ({"model": {"uri": "bundled://other"}, "resources": {"gpu": {"type": "nvidia-l4"}}}, "bundled models are"),
    ({"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpu": {"type": "nvidia-t4"}}}, "nvidia-t4"),
    (smol(replicas=-1), "spec.replicas must be at least 0"),
    (smol(engine={"gpuMemoryUtilization": 1.5}), "gpuMemoryUtilization must be in (0, 1]"),
    (smol(engine={"maxModelLen": "big"}), "spec.engine.maxModelLen must be an integer"),
    (smol(scaling={"maxReplicas": 2, "metrics": {"source": "prometheus"}}), "url is required"),
    ({"model": "x", "resources": {"gpu": {"type": "nvidia-l4"}}}, "spec.model must be an object"),
])
def test_bad_specs_name_the_field(spec, message):
    with pytest.raises(SpecError) as e:
        parse_inference_service(isvc(spec))
    assert message in str(e.value)


def test_scale_a_fixed_service_without_scaling_defaults_to_one_replica():
    assert parse_inference_service(isvc(smol())).replicas == 1
    s = parse_inference_service(isvc(smol(scaling={"maxReplicas": 3})))
    assert s.replicas is None and s.scaling.min_replicas == 1 and s.scaling.scale_down_stabilization_seconds == 300


def test_served_model_name_defaults_to_the_object_name():
    assert parse_inference_service(isvc(smol(), name="llm")).served_model_name == "llm"
    assert parse_inference_service(isvc({**smol(), "model": {"uri": "bundled://smollm2-135m-instruct",
                                                             "name": "smollm2"}})).served_model_name == "smollm2"
    assert MODEL_PROFILES["SmolLM2-135M"]  # the bundled model is in the catalog


def test_items_others_add_to_named_lists_are_not_drift_but_our_removals_are():
    _, _, dep = build(smol(template={"env": [{"name": "X", "value": "1"}]}))
    live = copy.deepcopy(dep)
    live["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "FOO", "value": "bar"})  # kubectl set env
    assert not differs(dep, live)
    _, _, without = build(smol())  # the user dropped template.env X: the hash moves, so we re-apply
    assert differs(without, live)
    assert without["metadata"]["annotations"]["serving.tokenmill.dev/desired-hash"] != \
        dep["metadata"]["annotations"]["serving.tokenmill.dev/desired-hash"]
    live2 = copy.deepcopy(dep)
    live2["spec"]["template"]["spec"]["tolerations"].append({"key": "other"})  # atomic list: ours to replace
    assert differs(dep, live2)


def test_probe_paths_are_served_by_the_engine_without_credentials():
    """The probes' paths against the real server app (loading, with an API key): kubelets send no
    Authorization header, so a probe path must answer 503 (not ready yet) or 200, never 401 or 404."""
    import asyncio

    import httpx
    from tokenmill.engine.server.app import build_app
    from tokenmill.engine.server.state import ServerState

    _, _, dep = build(smol())
    c = container(dep)
    app = build_app(ServerState(served_model_names=["chat"], api_key="sekrit"))

    async def get(path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pod") as client:
            return (await client.get(path)).status_code

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "http"
        assert asyncio.run(get(c[probe]["httpGet"]["path"])) in (200, 503), probe
    assert asyncio.run(get(c["readinessProbe"]["httpGet"]["path"])) == 503  # loading: no traffic yet
    assert asyncio.run(get(c["livenessProbe"]["httpGet"]["path"])) == 200  # loading is alive: no restart
