"""Reconciles of routed services against the dict-backed fake API (tests/test_operator_reconcile.py's): which
router children exist when, status.endpoint, the Routed condition, and the CRD guards. The real API server,
endpoint picker and Envoy run the same objects in e2e/test_routing.py."""

from test_operator_reconcile import NS, FakeApi, add_isvc, cond, deployment_ready, make_pods, run, smol

POOL_API = ("inference.networking.k8s.io", "v1", "inferencepools")
ROUTE_API = ("gateway.networking.k8s.io", "v1", "httproutes")


class ServedApi(FakeApi):
    """The fake API server, serving the given API groups (the InferencePool's, the Gateway API's)."""

    def __init__(self, *served: tuple[str, str, str]):
        super().__init__()
        self.served = set(served)

    def has_resource(self, group, version, plural):
        return (group, version, plural) in self.served


def kinds(api: FakeApi) -> set[tuple[str, str]]:
    return {(k[0], k[2]) for k in api.objects if k[0] != "InferenceService"}


def router_ready(api: FakeApi, name: str = "chat-router") -> None:
    api.objects[("Deployment", NS, name)]["status"] = {"readyReplicas": 1, "replicas": 1}


ROUTER = {("ServiceAccount", "chat-router"), ("RoleBinding", "chat-router"), ("ConfigMap", "chat-router"),
          ("Deployment", "chat-router"), ("Service", "chat-router"), ("InferencePool", "chat")}
ENGINES = {("Deployment", "chat"), ("Service", "chat"), ("PodDisruptionBudget", "chat")}


def test_routed_service_gets_its_router_and_the_routers_endpoint():
    api = ServedApi(POOL_API)
    add_isvc(api, smol(replicas=2, routing={"enabled": True}))
    status = run(api)
    assert kinds(api) == ENGINES | ROUTER
    assert status["endpoint"] == "http://chat-router.team-a.svc:8000/v1"
    assert status["routing"] == {"mode": "standalone", "inferencePool": "chat", "endpointPicker": "chat-router",
                                 "readyPickers": 0}
    deployment_ready(api)
    make_pods(api, 2)
    status = run(api)
    # the engines are ready, the router is not: the endpoint clients use does not serve yet
    assert (cond(status, "Routed")["status"], cond(status, "Routed")["reason"]) == ("False", "RouterStarting")
    assert (cond(status, "Ready")["status"], cond(status, "Ready")["reason"]) == ("False", "RouterStarting")
    assert cond(status, "Stalled")["status"] == "False"
    router_ready(api)
    status = run(api)
    assert cond(status, "Routed")["status"] == "True" and cond(status, "Ready")["status"] == "True"
    assert "at http://chat-router.team-a.svc:8000/v1" in cond(status, "Ready")["message"]
    api.writes.clear()
    run(api)
    assert api.writes == []  # steady state: nothing re-applied


def test_without_the_inferencepool_crd_nothing_starts_and_the_condition_says_what_to_install():
    api = ServedApi()
    add_isvc(api, smol(routing={"enabled": True}))
    status = run(api)
    assert kinds(api) == set()  # no GPU pods for a service that cannot be served as asked
    stalled = cond(status, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "InferencePoolNotInstalled")
    assert "inferencepools.inference.networking.k8s.io/v1" in stalled["message"]
    assert ("Warning", "InferencePoolNotInstalled") in {(e[0], e[1]) for e in api.events}


def test_turning_routing_off_deletes_the_router_and_restores_the_service_endpoint():
    api = ServedApi(POOL_API)
    add_isvc(api, smol(routing={"enabled": True}))
    run(api)
    body = api.objects[("InferenceService", NS, "chat")]
    body["spec"]["routing"] = {"enabled": False}
    body["metadata"]["generation"] = 2
    status = run(api)
    assert kinds(api) == {("Deployment", "chat"), ("Service", "chat")}
    assert status["endpoint"] == "http://chat.team-a.svc:8000/v1" and "routing" not in status
    assert not any(c["type"] == "Routed" for c in status["conditions"])
    assert sum(1 for e in api.events if e[1] == "Deleted") == len(ROUTER)


def test_gateway_mode_creates_a_route_and_stalls_while_the_gateway_is_missing():
    api = ServedApi(POOL_API, ROUTE_API)
    add_isvc(api, smol(routing={"enabled": True, "gateway": {"name": "inference"}}))
    status = run(api)
    assert ("HTTPRoute", "chat") in kinds(api) and "endpoint" not in status
    assert status["routing"]["mode"] == "gateway" and status["routing"]["httpRoute"] == "chat"
    stalled = cond(status, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "GatewayNotFound")
    assert "Gateway team-a/inference" in stalled["message"]
    # The Gateway appears, gets an address and accepts the route: routed at its address under /NS/NAME.
    api.objects[("Gateway", NS, "inference")] = {
        "spec": {"listeners": [{"name": "http", "protocol": "HTTP", "port": 80}]},
        "status": {"addresses": [{"type": "IPAddress", "value": "10.9.8.7"}]}}
    api.objects[("HTTPRoute", NS, "chat")]["status"] = {"parents": [{
        "parentRef": {"name": "inference"}, "conditions": [{"type": "Accepted", "status": "True"}]}]}
    router_ready(api)
    deployment_ready(api)
    make_pods(api, 1)
    status = run(api)
    assert status["endpoint"] == "http://10.9.8.7/team-a/chat/v1"
    assert cond(status, "Routed")["status"] == "True" and cond(status, "Ready")["status"] == "True"
    # A route the Gateway refuses (e.g. its listener does not allow this namespace) stalls with its words.
    api.objects[("HTTPRoute", NS, "chat")]["status"]["parents"][0]["conditions"][0].update(
        status="False", message="namespace team-a is not allowed")
    status = run(api)
    assert cond(status, "Stalled")["reason"] == "RouteNotAccepted"
    assert "namespace team-a is not allowed" in cond(status, "Routed")["message"]


def test_gateway_mode_without_the_gateway_api_says_so():
    api = ServedApi(POOL_API)
    add_isvc(api, smol(routing={"enabled": True, "gateway": {"name": "inference"}}))
    status = run(api)
    assert cond(status, "Stalled")["reason"] == "GatewayAPINotInstalled" and kinds(api) == set()


def test_a_router_name_taken_by_someone_else_is_a_conflict():
    api = ServedApi(POOL_API)
    api.objects[("ConfigMap", NS, "chat-router")] = {"kind": "ConfigMap", "metadata": {"name": "chat-router"}}
    add_isvc(api, smol(routing={"enabled": True}))
    status = run(api)
    assert cond(status, "Stalled")["reason"] == "NameConflict"
    assert "ConfigMap chat-router already exists" in cond(status, "Stalled")["message"]
