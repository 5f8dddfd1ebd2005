"""The engine pod both workload kinds run (a Deployment's pods, a LeaderWorkerSet's leaders): the
`tokenmill serve` argv with every sized number explicit, probes, resources, volumes, security context."""

import math

from tokenmill.operator.children import model_source
from tokenmill.operator.children.inferencepool import ENGINE_TYPE, ENGINE_TYPE_LABEL
from tokenmill.operator.children.lora_config import lora_engine_args, lora_volumes
from tokenmill.operator.children.meta import PORT, kueue_labels, labels
from tokenmill.operator.plan.catalog import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TYPES
from tokenmill.operator.plan.quota import parse_quantity
from tokenmill.operator.plan.sizing import SizingPlan, gpus_per_pod
from tokenmill.operator.plan.spec import ServiceSpec
from tokenmill.operator.plan.startup import startup_timeout_seconds

ENGINE_UID = 1000  # the engine image's non-root user
CACHE_DIR = "/cache"  # HOME and XDG_CACHE_HOME: GGUF conversions, Triton caches (per pod, emptyDir)
DEFAULT_ENGINE_IMAGE = "ghcr.io/tokenmill/tokenmill:0.1.0"
# The startup probe is what turns a loaded engine into a Ready pod: probed every 2 s, a replica joins the
# Service (and a woken scale-to-zero service answers its held request) within 2 s of loading, not 10.
STARTUP_PROBE_PERIOD = 2
# Probe paths on the engine's HTTP port. Readiness is what the Service routes on: /health answers 503
# while the model loads or downloads, when the engine core is dead or stalled, and while draining.
# Liveness (/live) restarts a wedged pod: 503 once the engine core has had work but made no step for
# the engine's --liveness-stall-seconds, or when it is dead; 200 while loading and while healthy.
READINESS_PATH = "/health"
LIVENESS_PATH = "/live"
# SIGTERM drains in-flight generations; the engine must finish (or abort) them before the kubelet kills.
TERMINATION_GRACE_SECONDS = 120
SHUTDOWN_GRACE_SECONDS = 110


def engine_args(spec: ServiceSpec, plan: SizingPlan) -> list[str]:
    """`tokenmill serve` arguments: every sized number is explicit, so the pod runs what status says.
    The one place the engine's argv is written (tests run the engine's own parser on it)."""
    args = []
    args += [
        "--model", model_source.model_argument(spec),
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--served-model-name", spec.served_model_name,
        "--max-model-len", str(plan.max_model_len),
        "--max-num-seqs", str(plan.max_num_seqs),
        "--block-size", str(plan.block_size),
        "--kv-cache-memory", str(plan.kv_cache_bytes),
        "--dtype", plan.dtype,
        "--max-waiting-requests", str(spec.max_waiting_requests),
        "--shutdown-grace-period", str(SHUTDOWN_GRACE_SECONDS),
    ]
    if plan.kv_cache_dtype != plan.dtype:  # an 8-bit cache: the bytes the plan counted (auto is the dtype's)
        args += ["--kv-cache-dtype", plan.kv_cache_dtype]
    if gpus_per_pod(plan) > 1:
        args += ["--tensor-parallel-size", str(gpus_per_pod(plan))]
    if plan.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(plan.pipeline_parallel_size)]
    if not spec.enable_prefix_caching:
        args += ["--no-enable-prefix-caching"]
    return args + lora_engine_args(spec)


def _node_affinity(spec: ServiceSpec) -> dict:
    """The GPU product requirement, ANDed into each of the user's node selector terms."""
    requirement = {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(GPU_TYPES[spec.gpu_type].products)}
    affinity = dict(spec.template.get("affinity") or {})
    node = dict(affinity.get("nodeAffinity") or {})
    required = dict(node.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or [{}]]
    for term in terms:
        term["matchExpressions"] = [*(term.get("matchExpressions") or []), requirement]
    required["nodeSelectorTerms"] = terms
    node["requiredDuringSchedulingIgnoredDuringExecution"] = required
    affinity["nodeAffinity"] = node
    return affinity


def _probe(path: str, period: int, failures: int, timeout: int) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def pod_memory(spec: ServiceSpec, plan: SizingPlan) -> str:
    """The pod's memory request and limit: spec.resources.memory, or the plan's host memory at the load's
    peak where that is more (sizing.host_memory_bytes), so that no pod is OOM-killed while it loads."""
    if parse_quantity(spec.memory) >= plan.host_memory_bytes:
        return spec.memory
    return str(plan.host_memory_bytes)


def pod_template(spec: ServiceSpec, plan: SizingPlan, image: str, hf_endpoint: str | None = None) -> dict:
    """The engine pod template (metadata and spec) of a Deployment, or of a LeaderWorkerSet's leader."""
    t = spec.template
    gpus = str(gpus_per_pod(plan))
    memory = pod_memory(spec, plan)
    startup = startup_timeout_seconds(spec, plan)
    env = [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        *model_source.env(spec, hf_endpoint),
    ]
    if spec.api_key_secret is not None:
        secret, key = spec.api_key_secret
        env.append({"name": "TOKENMILL_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    ours = {e["name"] for e in env}
    env += [e for e in t.get("env") or [] if isinstance(e, dict) and e.get("name") not in ours]

    mounts = [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes = [
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        # NCCL and the engine's IPC use shared memory; the container runtime's default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    ]
    model_volumes, model_mounts = model_source.volumes(spec)
    volumes += model_volumes
    mounts += model_mounts
    adapter_volumes, adapter_mounts = lora_volumes(spec)
    volumes += adapter_volumes
    mounts += adapter_mounts

    container = {
        "name": "engine",
        "image": t.get("image") or image,
        "command": ["tokenmill", "serve"],
        "args": engine_args(spec, plan),
        "env": env,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": spec.cpu, "memory": memory, GPU_RESOURCE: gpus},
            # No CPU limit: throttling stalls tokenization and streaming; memory and GPUs are hard limits.
            "limits": {"memory": memory, GPU_RESOURCE: gpus},
        },
        # Startup: up to the startup budget (download + load) before the other two probes begin.
        "startupProbe": _probe(READINESS_PATH, STARTUP_PROBE_PERIOD, math.ceil(startup / STARTUP_PROBE_PERIOD), 5),
        "readinessProbe": _probe(READINESS_PATH, 5, 3, 3),  # out of the Service after 15 s of failures
        "livenessProbe": _probe(LIVENESS_PATH, 15, 4, 5),  # restarted after 60 s of failures
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
        },
        "volumeMounts": mounts,
    }
    if t.get("imagePullPolicy"):
        container["imagePullPolicy"] = t["imagePullPolicy"]

    pod_spec = {
        "automountServiceAccountToken": False,  # the engine never talks to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "affinity": _node_affinity(spec),
        # GPU node pools are commonly tainted so that only GPU workloads land there.
        "tolerations": [
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
            *(t.get("tolerations") or []),
        ],
        "containers": [container],
        "volumes": volumes,
    }
    for key in ("nodeSelector", "priorityClassName", "serviceAccountName", "runtimeClassName", "imagePullSecrets"):
        if t.get(key):
            pod_spec[key] = t[key]

    # The engine-type label tells an endpoint picker which metric names the engine speaks (vLLM's).
    pod_labels = {**(t.get("labels") or {}), **labels(spec.name), ENGINE_TYPE_LABEL: ENGINE_TYPE,
                  **kueue_labels(spec)}
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
        **(t.get("annotations") or {}),
    }
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}

