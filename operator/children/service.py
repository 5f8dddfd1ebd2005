"""The ClusterIP Service in front of the engine pods, and the OpenAI base URL it gives."""

from tokenmill.operator.children.meta import PORT, child_metadata, selector_labels, stamp
from tokenmill.operator.plan.spec import ServiceSpec


def endpoint(spec: ServiceSpec) -> str:
    """In-cluster OpenAI base URL; the short form resolves under any cluster domain."""
    return f"http://{spec.name}.{spec.namespace}.svc:{PORT}/v1"



def desired_service(spec: ServiceSpec, only: dict[str, str] | None = None) -> dict:
    """`only`: extra selector labels (a multi-node service sends traffic to its leaders only)."""
    return stamp({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(spec),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector_labels(spec.name), **(only or {})},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}],
        },
    })

