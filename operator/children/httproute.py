"""The HTTPRoute (gateway.networking.k8s.io/v1) that attaches a routed InferenceService to the Gateway it
names (spec.routing.gateway): requests under /NAMESPACE/NAME/ go to the InferencePool, with that prefix
removed, so one Gateway serves many services and each client keeps the OpenAI paths (/v1/...) after its
service's prefix. The Gateway's implementation (kgateway, Istio, Envoy Gateway, GKE) asks the pool's
endpoint picker for the pod."""

from tokenmill.operator.children.inferencepool import POOL_GROUP, POOL_KIND
from tokenmill.operator.children.meta import child_metadata, stamp
from tokenmill.operator.plan.spec import ServiceSpec

GATEWAY_GROUP, GATEWAY_VERSION = "gateway.networking.k8s.io", "v1"


def route_prefix(spec: ServiceSpec) -> str:
    return f"/{spec.namespace}/{spec.name}"


def gateway_namespace(spec: ServiceSpec) -> str:
    return spec.routing.gateway_namespace or spec.namespace


def gateway_api_not_installed_message() -> str:
    return (f"spec.routing.gateway names a Gateway, but the API server does not serve httproutes."
            f"{GATEWAY_GROUP}/{GATEWAY_VERSION}: install the Gateway API CRDs and an implementation that supports "
            "InferencePool backends, or drop spec.routing.gateway for the operator's standalone Envoy")


def desired_httproute(spec: ServiceSpec) -> dict:
    return stamp({
        "apiVersion": f"{GATEWAY_GROUP}/{GATEWAY_VERSION}",
        "kind": "HTTPRoute",
        "metadata": child_metadata(spec),
        "spec": {
            "parentRefs": [{"group": GATEWAY_GROUP, "kind": "Gateway", "name": spec.routing.gateway_name,
                            "namespace": gateway_namespace(spec)}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": route_prefix(spec)}}],
                "filters": [{"type": "URLRewrite",
                             "urlRewrite": {"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}],
                "backendRefs": [{"group": POOL_GROUP, "kind": POOL_KIND, "name": spec.name}],
                # A request may wait in the picker's queue while the service wakes from zero, then stream
                # for minutes: no gateway-imposed limit ("0s" disables it).
                "timeouts": {"request": "0s"},
            }],
        },
    })


def gateway_endpoint(spec: ServiceSpec, gateway: dict | None) -> str | None:
    """The OpenAI base URL through the Gateway: its first address and the port of its first HTTP listener;
    None until the Gateway has an address."""
    addresses = ((gateway or {}).get("status") or {}).get("addresses") or []
    if not addresses or not addresses[0].get("value"):
        return None
    host = addresses[0]["value"]
    listeners = [li for li in ((gateway or {}).get("spec") or {}).get("listeners") or []
                 if li.get("protocol") in ("HTTP", "HTTPS")]
    scheme = "https" if listeners and listeners[0]["protocol"] == "HTTPS" else "http"
    port = listeners[0].get("port") if listeners else 80
    default = 443 if scheme == "https" else 80
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}{'' if port == default else f':{port}'}{route_prefix(spec)}/v1"
