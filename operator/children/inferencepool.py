"""The InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) of a routed
InferenceService: the engine pods it selects, their port, and the endpoint picker that chooses among them.
A multi-node service's pool holds its leaders only (workers serve no HTTP)."""

from tokenmill.operator.children.meta import PORT, child_metadata, selector_labels, stamp
from tokenmill.operator.plan.spec import ServiceSpec

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
POOL_KIND = "InferencePool"
# The pod label the endpoint picker's metrics extractor reads to know which metric names a model server
# speaks; tokenmill's engine speaks vLLM's (engine/metric_names.py).
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "vllm"
EXT_PROC_PORT = 9002  # the endpoint picker's gRPC ext_proc port (its Service's too)


def router_name(spec: ServiceSpec) -> str:
    """The endpoint picker's Deployment, Service, ConfigMap and ServiceAccount (and Envoy's, standalone)."""
    return f"{spec.name}-router"


def pool_not_installed_message() -> str:
    return (f"spec.routing.enabled needs the InferencePool CRD ({POOL_PLURAL}.{POOL_GROUP}/{POOL_VERSION}), which "
            "the API server does not serve: install the Gateway API Inference Extension's CRDs (v1.x, "
            "config/crd/bases in sigs.k8s.io/gateway-api-inference-extension), or set routing.enabled false")


def desired_inference_pool(spec: ServiceSpec, only: dict[str, str] | None = None) -> dict:
    """`only`: extra selector labels (a multi-node service's leaders)."""
    return stamp({
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": POOL_KIND,
        "metadata": child_metadata(spec),
        "spec": {
            "selector": {"matchLabels": {**selector_labels(spec.name), **(only or {})}},
            "targetPorts": [{"number": PORT}],
            "endpointPickerRef": {"kind": "Service", "name": router_name(spec), "port": {"number": EXT_PROC_PORT},
                                  # No ready picker means no routing decision: fail closed (503) rather than
                                  # let a gateway spray requests at random pods.
                                  "failureMode": "FailClose"},
        },
    })
