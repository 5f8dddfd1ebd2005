"""Desired children of an InferenceService as plain dicts: Deployment, Service, PodDisruptionBudget."""

import hashlib
import json
import math

from tokenmill.operator.children import model_source
from tokenmill.operator.plan.catalog import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TYPES
from tokenmill.operator.plan.sizing import SizingPlan, gpus_per_pod
from tokenmill.operator.plan.spec import API_VERSION, KIND, ServiceSpec

PORT = 8000
OPERATOR_NAME = "tokenmill-operator"
SERVICE_LABEL = "serving.tokenmill.dev/inferenceservice"
DESIRED_HASH = "serving.tokenmill.dev/desired-hash"
MANAGED_BY = "app.kubernetes.io/managed-by"
ENGINE_UID = 1000  # the engine image's non-root user
CACHE_DIR = "/cache"  # HOME and XDG_CACHE_HOME: GGUF conversions, Triton caches (per pod, emptyDir)
DEFAULT_ENGINE_IMAGE = "ghcr.io/tokenmill/tokenmill:0.1.0"
# Startup budget: a fixed part (CUDA init, GGUF conversion, CUDA-graph capture) plus reading the
# weights at a pessimistic 100 MB/s (network volumes); users can set engine.startupTimeoutSeconds.
STARTUP_BASE_SECONDS = 600
STARTUP_BYTES_PER_SECOND = 100e6
# hf:// models may be downloaded first (an empty cache): the whole checkpoint at a pessimistic 50 MB/s.
STARTUP_DOWNLOAD_BYTES_PER_SECOND = 50e6
STARTUP_PROBE_PERIOD = 10
# Probe paths on the engine's HTTP port. Readiness is what the Service routes on: /health answers 503
# while the model loads or downloads, when the engine core is dead or stalled, and while draining.
# Liveness (/live) restarts a wedged pod: 503 once the engine core has had work but made no step for
# the engine's --liveness-stall-seconds, or when it is dead; 200 while loading and while healthy.
READINESS_PATH = "/health"
LIVENESS_PATH = "/live"
# SIGTERM drains in-flight generations; the engine must finish (or abort) them before the kubelet kills.
TERMINATION_GRACE_SECONDS = 120
SHUTDOWN_GRACE_SECONDS = 110


def selector_labels(name: str) -> dict[str, str]:
    return {SERVICE_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/name": "tokenmill-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        MANAGED_BY: OPERATOR_NAME,
    }


def owner_reference(spec: ServiceSpec) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def endpoint(spec: ServiceSpec) -> str:
    """In-cluster OpenAI base URL; the short form resolves under any cluster domain."""
    return f"http://{spec.name}.{spec.namespace}.svc:{PORT}/v1"


def startup_timeout_seconds(spec: ServiceSpec, plan: SizingPlan) -> int:
    if spec.startup_timeout_seconds is not None:
        return spec.startup_timeout_seconds
    budget = STARTUP_BASE_SECONDS + math.ceil(plan.weights_bytes_per_gpu / STARTUP_BYTES_PER_SECOND)
    if spec.model_scheme == "hf":
        budget += math.ceil(plan.weights_bytes / STARTUP_DOWNLOAD_BYTES_PER_SECOND)
    return budget


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
    if gpus_per_pod(plan) > 1:
        args += ["--tensor-parallel-size", str(gpus_per_pod(plan))]
    if plan.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(plan.pipeline_parallel_size)]
    if not spec.enable_prefix_caching:
        args += ["--no-enable-prefix-caching"]
    return args


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


def pod_template(spec: ServiceSpec, plan: SizingPlan, image: str, hf_endpoint: str | None = None) -> dict:
    """The engine pod template (metadata and spec) of a Deployment, or of a LeaderWorkerSet's leader."""
    t = spec.template
    gpus = str(gpus_per_pod(plan))
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

    container = {
        "name": "engine",
        "image": t.get("image") or image,
        "command": ["tokenmill", "serve"],
        "args": engine_args(spec, plan),
        "env": env,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": spec.cpu, "memory": spec.memory, GPU_RESOURCE: gpus},
            # No CPU limit: throttling stalls tokenization and streaming; memory and GPUs are hard limits.
            "limits": {"memory": spec.memory, GPU_RESOURCE: gpus},
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

    pod_labels = {**(t.get("labels") or {}), **labels(spec.name)}
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
        **(t.get("annotations") or {}),
    }
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}


def desired_deployment(spec: ServiceSpec, plan: SizingPlan, replicas: int, image: str,
                       hf_endpoint: str | None = None) -> dict:
    startup = startup_timeout_seconds(spec, plan)
    return stamp({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # GPUs are scarce and quota-capped: replace pods one at a time instead of surging an extra
            # replica that may find no free GPU or no quota (a stuck rollout).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            # The Deployment must not call a slow model load a failed rollout.
            "progressDeadlineSeconds": startup + 300,
            "revisionHistoryLimit": 3,
            "template": pod_template(spec, plan, image, hf_endpoint),
        },
    })


def desired_service(spec: ServiceSpec, only: dict[str, str] | None = None) -> dict:
    """`only`: extra selector labels (a multi-node service sends traffic to its leaders only)."""
    return stamp({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector_labels(spec.name), **(only or {})},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}],
        },
    })


def wants_pdb(spec: ServiceSpec) -> bool:
    """A PDB when the service may run more than one replica. Decided from the spec, not the current
    count, so autoscaling does not create and delete it back and forth."""
    if spec.scaling is not None:
        return spec.scaling.max_replicas > 1
    return (spec.replicas or 0) > 1


def desired_pdb(spec: ServiceSpec) -> dict | None:
    if not wants_pdb(spec):
        return None
    return stamp({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # Let drains evict pods that are not serving anyway (crash-looping, still loading).
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    })


def child_metadata(spec: ServiceSpec) -> dict:
    """Name, namespace, labels and the owner reference every child carries."""
    return _metadata(spec)


def _metadata(spec: ServiceSpec) -> dict:
    return {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": labels(spec.name),
        "ownerReferences": [owner_reference(spec)],
    }


def is_owned_by(obj: dict, spec: ServiceSpec) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == spec.uid and r.get("kind") == KIND for r in refs)


def stamp(obj: dict) -> dict:
    """Record a hash of the desired object on it: when our own desired state drops a field, the hash
    changes and the next apply removes the field (a field-by-field comparison cannot see a removal)."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    obj["metadata"]["annotations"] = {**obj["metadata"].get("annotations", {}), DESIRED_HASH: digest}
    return obj


def differs(desired: object, live: object) -> bool:
    """Whether applying `desired` would change `live`: every value we set must be there as we set it.

    Mirrors server-side apply: fields others set (or the API server defaults) are ignored; lists of
    named items (containers, env, volumes, ports) merge by name, so items others added are theirs;
    other lists (args, tolerations, node selector terms) are atomic and must match exactly.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return True
        return any(differs(v, live.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list):
            return True
        if desired and all(isinstance(d, dict) and "name" in d for d in desired):
            by_name = {x.get("name"): x for x in live if isinstance(x, dict)}
            return any(differs(d, by_name.get(d["name"])) for d in desired)
        return len(desired) != len(live) or any(differs(d, x) for d, x in zip(desired, live, strict=True))
    return desired != live
