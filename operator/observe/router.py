"""What the cluster holds of a routed service's router (spec.routing): its children as they are, the
router pods, the Gateway an HTTPRoute attaches to; and what stops the router being written (the
InferencePool or Gateway API CRDs not served)."""

from dataclasses import dataclass, field

from tokenmill.operator.children.httproute import (
    GATEWAY_GROUP,
    GATEWAY_VERSION,
    gateway_api_not_installed_message,
    gateway_namespace,
)
from tokenmill.operator.children.inferencepool import (
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    pool_not_installed_message,
    router_name,
)
from tokenmill.operator.children.meta import is_owned_by
from tokenmill.operator.children.router import ROUTER_LABEL
from tokenmill.operator.plan.spec import ServiceSpec

# kind -> the name it has, for a service called NAME: the pool and the route carry the service's name.
ROUTER_KINDS = ("ServiceAccount", "RoleBinding", "ConfigMap", "Deployment", "Service", "InferencePool", "HTTPRoute")


def router_child_name(spec: ServiceSpec, kind: str) -> str:
    return spec.name if kind in ("InferencePool", "HTTPRoute") else router_name(spec)


@dataclass(frozen=True, slots=True)
class RouterLive:
    objects: dict[str, dict] = field(default_factory=dict)  # by kind: the router children that exist
    foreign: list[str] = field(default_factory=list)  # kinds whose object under our name is not ours
    pods: list[dict] = field(default_factory=list)  # the router's pods
    gateway: dict | None = None  # the Gateway of spec.routing.gateway, when named and found


def read_router(api, spec: ServiceSpec, previous: dict) -> RouterLive:
    """Read only for a routed service, or one that was (its router is deleted once routing is off)."""
    if spec.routing is None and not previous.get("routing"):
        return RouterLive()
    objects, foreign = {}, []
    for kind in ROUTER_KINDS:
        if kind == "HTTPRoute" and not ((previous.get("routing") or {}).get("httpRoute")
                                        or (spec.routing and spec.routing.gateway_name)):
            continue  # a standalone service never reads HTTPRoutes (no Gateway API needed)
        if kind == "InferencePool" and spec.routing is None and not (previous.get("routing") or {}).get("inferencePool"):
            continue
        obj = api.get(kind, spec.namespace, router_child_name(spec, kind))
        if obj is None:
            continue
        if is_owned_by(obj, spec):
            objects[kind] = obj
        else:
            foreign.append(kind)
    pods = [p for p in api.list("Pod", spec.namespace, f"{ROUTER_LABEL}={spec.name}")
            if ((p.get("metadata") or {}).get("labels") or {}).get(ROUTER_LABEL) == spec.name]
    gateway = None
    if spec.routing is not None and spec.routing.gateway_name:
        # A kind the API server does not serve reads as absent (404), like a missing object.
        gateway = api.get("Gateway", gateway_namespace(spec), spec.routing.gateway_name)
    return RouterLive(objects, foreign, pods, gateway)


def router_blocker(api, spec: ServiceSpec, live: RouterLive) -> tuple[str, str] | None:
    """(reason, message) when the router cannot be written: a CRD it needs is not served, or a name is taken."""
    if spec.routing is None:
        return None
    if live.foreign:
        kinds = ", ".join(f"{k} {router_child_name(spec, k)}" for k in live.foreign)
        return "NameConflict", f"{kinds} already exists and is not owned by this InferenceService"
    if "InferencePool" not in live.objects and not api.has_resource(POOL_GROUP, POOL_VERSION, POOL_PLURAL):
        return "InferencePoolNotInstalled", pool_not_installed_message()
    if spec.routing.gateway_name and "HTTPRoute" not in live.objects and \
            not api.has_resource(GATEWAY_GROUP, GATEWAY_VERSION, "httproutes"):
        return "GatewayAPINotInstalled", gateway_api_not_installed_message()
    return None
