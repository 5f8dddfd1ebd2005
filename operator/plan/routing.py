"""The `Routed` condition of a routed service (spec.routing), from what its router looks like: whether
requests sent to status.endpoint reach the engines through the endpoint picker. Pure."""

from dataclasses import dataclass

from tokenmill.operator.plan.conditions import Condition


@dataclass(frozen=True, slots=True)
class RouterState:
    mode: str  # "standalone" (the operator's Envoy beside the picker) or "gateway" (an HTTPRoute)
    pool: str
    ready_pods: int  # router pods ready (the picker synced with its pool, and Envoy up in standalone mode)
    endpoint: str | None  # status.endpoint: None while a Gateway has no address
    gateway: str = ""  # namespace/name, gateway mode
    gateway_found: bool = True
    route_accepted: tuple[str, str] | None = None  # (status, message) of the Gateway's Accepted on our route


def routed_condition(s: RouterState) -> tuple[Condition, tuple[str, str] | None]:
    """(Routed, stall): `stall` is (reason, message) when only a human can fix it (Stalled=True), while the
    engines and the router are still kept as the spec says."""
    if s.mode == "gateway":
        if not s.gateway_found:
            text = (f"Gateway {s.gateway} (spec.routing.gateway) does not exist: create it, or drop "
                    "spec.routing.gateway for the operator's standalone Envoy")
            return Condition("Routed", "False", "GatewayNotFound", text), ("GatewayNotFound", text)
        if s.route_accepted is not None and s.route_accepted[0] == "False":
            text = f"Gateway {s.gateway} did not accept HTTPRoute {s.pool}: {s.route_accepted[1]}"
            return Condition("Routed", "False", "RouteNotAccepted", text), ("RouteNotAccepted", text)
    if s.ready_pods < 1:
        what = "endpoint picker and Envoy" if s.mode == "standalone" else "endpoint picker"
        return Condition("Routed", "False", "RouterStarting",
                         f"the {what} of InferencePool {s.pool} is not ready yet (it becomes ready once it has "
                         "read the pool and its pods)"), None
    if s.mode == "gateway" and (s.endpoint is None or s.route_accepted is None):
        return Condition("Routed", "False", "WaitingForGateway",
                         f"waiting for Gateway {s.gateway} to accept HTTPRoute {s.pool} and publish an address"), None
    return Condition("Routed", "True", "Routed",
                     f"requests to {s.endpoint} go through the endpoint picker of InferencePool {s.pool}"), None
