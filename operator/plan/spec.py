"""InferenceService: API names, defaults, and the parse of a custom object into typed settings.

The API server validates manifests against the CRD first; this parse is the second line, so an object
stored before a CRD upgrade (or with validation bypassed) becomes a clear `InvalidSpec` condition
instead of a crash. The defaults here are the CRD's defaults (a test keeps them equal).
"""

import re
from dataclasses import dataclass, field

from tokenmill.engine import kv_memory
from tokenmill.operator.plan.catalog import GPU_TYPES
from tokenmill.operator.plan.sizing import EngineSettings, resolve_dtype

GROUP = "serving.tokenmill.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
API_VERSION = f"{GROUP}/{VERSION}"

MODEL_SCHEMES = ("bundled", "pvc", "hf", "file")
BUNDLED_MODELS = ("smollm2-135m-instruct",)
# gpu.count is any count of one node's GPUs (the CRD's maximum); whether it splits the model's heads is
# sizing's check (Sized=False, reason InvalidGPUCount), and the CRD's for the bundled model.
MAX_GPU_COUNT = max(g.gpus_per_node for g in GPU_TYPES.values())
# The Hub's repo id rules (ORG/NAME of letters, digits, '-', '_', '.'), then an optional @REVISION: a
# branch, a tag or a commit sha. The CRD's CEL rule is the same pattern.
# Kueue's opt-in labels, read from the InferenceService's own metadata (the one source of truth: there is
# no spec field for them) and copied onto the Deployment or LeaderWorkerSet, where Kueue's integrations read them.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUEUE_GATE = "kueue.x-k8s.io/admission"  # the scheduling gate Kueue's pod webhook puts on each pod it holds
HF_URI = re.compile(r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[-A-Za-z0-9_./]+)?$")
CACHE_ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod")
# The CRD's CEL rule says the same.
SCALE_TO_ZERO_NEEDS_ROUTING = (
    "scaling.minReplicas 0 (scale to zero) needs spec.routing.enabled: true: the router's endpoint picker holds "
    "requests while a replica starts; without it a request to a service at 0 replicas has nowhere to wait")

DEFAULTS = {
    "engine.dtype": "auto",
    "engine.kvCacheDtype": "auto",
    "engine.blockSize": 16,
    "engine.maxModelLen": "auto",
    "engine.maxNumSeqs": "auto",
    "engine.gpuMemoryUtilization": 0.9,
    "engine.enablePrefixCaching": True,
    "engine.maxWaitingRequests": 256,
    "resources.cpu": "4",
    "resources.memory": "32Gi",
    "scaling.minReplicas": 1,
    "scaling.idleSeconds": 300,
    "scaling.targetQueueDepth": "auto",
    "scaling.scaleUpStabilizationSeconds": 0,
    "scaling.scaleDownStabilizationSeconds": 300,
    "scaling.metrics.source": "pods",
    "apiKeySecretRef.key": "api-key",
    "model.tokenSecretRef.key": "HF_TOKEN",
    "routing.enabled": False,
    "model.lora.maxRank": 16,
    "model.lora.maxAdapters": 4,
}
LORA_NAME = re.compile(r"^[^,\s]{1,256}$")  # the CRD's pattern: vllm:lora_requests_info lists names comma-joined
LORA_SCHEMES = ("pvc", "hf", "file")


class SpecError(ValueError):
    """A spec the operator cannot act on; the message names the field and the limit."""


@dataclass(frozen=True, slots=True)
class ScalingSpec:
    min_replicas: int
    max_replicas: int
    target_queue_depth: int | None  # None = from capacity
    scale_up_stabilization_seconds: int
    scale_down_stabilization_seconds: int
    metrics_source: str  # pods | prometheus
    prometheus_url: str | None = None
    prometheus_query: str | None = None
    # With minReplicas 0 (routing only): seconds without a request before the service goes to 0 replicas.
    idle_seconds: int = 300


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """spec.routing: an InferencePool and its endpoint picker in front of the engine pods, reached through
    the named Gateway (an HTTPRoute) or, with none named, the operator's own Envoy (standalone)."""

    gateway_name: str | None = None
    gateway_namespace: str | None = None  # None: the service's namespace


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    uri: str


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """spec.model.lora (KServe's names): the adapters, and the engine's slots for them."""

    adapters: tuple[LoRAAdapter, ...]
    max_rank: int  # --max-lora-rank
    max_adapters: int  # --max-loras

    @property
    def hub(self) -> bool:
        return any(a.uri.startswith("hf://") for a in self.adapters)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """spec.model.cache: where hf:// downloads are kept for all pods of the service."""

    claim_name: str | None  # an existing PVC the user names
    size: str | None  # or the operator creates NAME-model-cache of this size
    storage_class: str | None = None
    access_mode: str | None = None  # None: ReadWriteMany when more than one replica is possible


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    namespace: str
    uid: str
    generation: int
    model_uri: str
    served_model_name: str
    profile: dict | None
    engine: EngineSettings
    enable_prefix_caching: bool
    max_waiting_requests: int
    startup_timeout_seconds: int | None
    gpu_type: str
    gpu_count: int | None
    cpu: str
    memory: str
    replicas: int | None  # fixed size; None when scaling is set
    scaling: ScalingSpec | None
    template: dict = field(default_factory=dict)
    api_key_secret: tuple[str, str] | None = None  # (name, key)
    token_secret: tuple[str, str] | None = None  # (name, key): HF_TOKEN for gated hf:// models
    cache: CacheSpec | None = None
    lora: LoRASpec | None = None
    routing: RoutingSpec | None = None  # None: no router (spec.routing.enabled false or absent)
    # Kueue's labels on the InferenceService (plan/kueue.py): copied onto the workload it makes.
    queue_name: str | None = None
    priority_class: str | None = None

    @property
    def model_scheme(self) -> str:
        return self.model_uri.split("://", 1)[0]

    @property
    def model_path(self) -> str:
        return self.model_uri.split("://", 1)[1]

    @property
    def model_name(self) -> str:
        """The URI without its @REVISION: what the catalog is matched against."""
        return self.model_uri.partition("@")[0] if self.model_scheme == "hf" else self.model_uri


def _get(obj: dict, path: str, default=None):
    for part in path.split("."):
        if not isinstance(obj, dict):
            raise SpecError(f"spec.{path.rsplit('.', 1)[0]} must be an object")
        obj = obj.get(part)
        if obj is None:
            return default
    return obj


def _int(value, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where} must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(f"{where} must be at least {minimum}, got {value}")
    return value


def _auto_or_int(value, where: str, minimum: int = 1) -> int | None:
    if value == "auto":
        return None
    return _int(value, where, minimum)


def _str(value, where: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where} must be a non-empty string, got {value!r}")
    return value


def parse_inference_service(body: dict) -> ServiceSpec:
    """Typed settings from an InferenceService object; SpecError names the first bad field."""
    try:
        return _parse(body)
    except SpecError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # malformed shapes
        raise SpecError(f"malformed spec: {e}") from None


def _parse(body: dict) -> ServiceSpec:
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(spec, dict):
        raise SpecError("spec is missing")
    d = DEFAULTS

    def get(path: str):
        return _get(spec, path, d.get(path))

    uri = _str(get("model.uri"), "spec.model.uri")
    scheme, _, rest = uri.partition("://")
    if scheme not in MODEL_SCHEMES or not rest:
        raise SpecError(f"spec.model.uri {uri!r} must start with one of {', '.join(s + '://' for s in MODEL_SCHEMES)}")
    if scheme == "bundled" and rest not in BUNDLED_MODELS:
        raise SpecError(f"spec.model.uri {uri!r}: the bundled models are {', '.join(BUNDLED_MODELS)}")
    if scheme == "pvc" and "/" not in rest.strip("/"):
        raise SpecError(f"spec.model.uri {uri!r} must be pvc://CLAIM/PATH")
    if scheme == "hf" and not HF_URI.match(uri):
        raise SpecError(f"spec.model.uri {uri!r} must be hf://ORG/NAME or hf://ORG/NAME@REVISION")
    if scheme == "file" and not rest.startswith("/"):
        raise SpecError(f"spec.model.uri {uri!r} must be file:///ABSOLUTE/PATH")
    token_secret, cache = None, None
    if _get(spec, "model.tokenSecretRef") is not None:
        token_secret = (_str(get("model.tokenSecretRef.name"), "spec.model.tokenSecretRef.name"),
                        _str(get("model.tokenSecretRef.key"), "spec.model.tokenSecretRef.key"))
    if _get(spec, "model.cache") is not None:
        cache = _parse_cache(get)
    served = get("model.name") or meta.get("name")
    lora = _parse_lora(get, served) if _get(spec, "model.lora") is not None else None
    if (token_secret or cache) and scheme != "hf" and not (lora is not None and lora.hub):
        raise SpecError("spec.model.tokenSecretRef and spec.model.cache apply to hf:// models (or hf:// LoRA adapters) only")
    profile = get("model.profile")
    if profile is not None and not isinstance(profile, dict):
        raise SpecError("spec.model.profile must be an object")

    dtype = _str(get("engine.dtype"), "spec.engine.dtype")
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise SpecError(f"spec.engine.dtype {dtype!r} must be auto, bfloat16, float16 or float32")
    kv_cache_dtype = _str(get("engine.kvCacheDtype"), "spec.engine.kvCacheDtype")
    try:
        kv_memory.resolve_kv_cache_dtype(kv_cache_dtype, resolve_dtype(dtype))
    except ValueError as e:
        raise SpecError(f"spec.engine.kvCacheDtype: {e}") from None
    util = get("engine.gpuMemoryUtilization")
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise SpecError(f"spec.engine.gpuMemoryUtilization must be in (0, 1], got {util!r}")
    block_size = _int(get("engine.blockSize"), "spec.engine.blockSize", 1)
    if block_size not in (16, 32):
        raise SpecError(f"spec.engine.blockSize must be 16 or 32, got {block_size}")
    engine = EngineSettings(
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        max_model_len=_auto_or_int(get("engine.maxModelLen"), "spec.engine.maxModelLen"),
        max_num_seqs=_auto_or_int(get("engine.maxNumSeqs"), "spec.engine.maxNumSeqs"),
        gpu_memory_utilization=float(util),
        max_loras=lora.max_adapters if lora is not None else 0,
        max_lora_rank=lora.max_rank if lora is not None else 0,
    )
    startup = get("engine.startupTimeoutSeconds")

    gpu_type = _str(get("resources.gpu.type"), "spec.resources.gpu.type")
    if gpu_type not in GPU_TYPES:
        raise SpecError(f"spec.resources.gpu.type {gpu_type!r} is not one of {', '.join(GPU_TYPES)}")
    gpu_count = get("resources.gpu.count")
    if gpu_count is not None and _int(gpu_count, "spec.resources.gpu.count", 1) > MAX_GPU_COUNT:
        raise SpecError(f"spec.resources.gpu.count must be 1 to {MAX_GPU_COUNT} (the GPUs of one node), got {gpu_count}")

    replicas = spec.get("replicas")
    scaling_spec = spec.get("scaling")
    if replicas is not None and scaling_spec is not None:
        raise SpecError("spec.replicas and spec.scaling are mutually exclusive")
    routing = _parse_routing(get) if get("routing.enabled") is True else None
    scaling = None
    if scaling_spec is not None:
        scaling = _parse_scaling(get)
        if scaling.min_replicas == 0 and routing is None:
            raise SpecError(SCALE_TO_ZERO_NEEDS_ROUTING)
    else:
        replicas = 1 if replicas is None else _int(replicas, "spec.replicas", 0)

    template = spec.get("template") or {}
    if not isinstance(template, dict):
        raise SpecError("spec.template must be an object")
    secret = None
    if spec.get("apiKeySecretRef") is not None:
        secret = (_str(get("apiKeySecretRef.name"), "spec.apiKeySecretRef.name"),
                  _str(get("apiKeySecretRef.key"), "spec.apiKeySecretRef.key"))
    name = _str(meta.get("name"), "metadata.name")
    own_labels = meta.get("labels") or {}
    if not isinstance(own_labels, dict):
        raise SpecError("metadata.labels must be an object")
    return ServiceSpec(
        name=name,
        namespace=_str(meta.get("namespace"), "metadata.namespace"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        model_uri=uri,
        served_model_name=_str(get("model.name") or name, "spec.model.name"),
        profile=profile,
        engine=engine,
        enable_prefix_caching=bool(get("engine.enablePrefixCaching")),
        max_waiting_requests=_int(get("engine.maxWaitingRequests"), "spec.engine.maxWaitingRequests", 0),
        startup_timeout_seconds=None if startup is None else _int(startup, "spec.engine.startupTimeoutSeconds", 60),
        gpu_type=gpu_type,
        gpu_count=gpu_count,
        cpu=_str(get("resources.cpu"), "spec.resources.cpu"),
        memory=_str(get("resources.memory"), "spec.resources.memory"),
        replicas=replicas,
        scaling=scaling,
        template=template,
        api_key_secret=secret,
        token_secret=token_secret,
        cache=cache,
        lora=lora,
        routing=routing,
        queue_name=own_labels.get(QUEUE_LABEL) or None,
        priority_class=own_labels.get(PRIORITY_LABEL) or None,
    )


def _parse_lora(get, served_name: str | None) -> LoRASpec:
    raw = get("model.lora.adapters") or []
    if not isinstance(raw, list):
        raise SpecError("spec.model.lora.adapters must be a list of {name, uri}")
    adapters, seen = [], set()
    for i, a in enumerate(raw):
        where = f"spec.model.lora.adapters[{i}]"
        if not isinstance(a, dict):
            raise SpecError(f"{where} must be an object with name and uri")
        name, uri = _str(a.get("name"), f"{where}.name"), _str(a.get("uri"), f"{where}.uri")
        if not LORA_NAME.match(name):
            raise SpecError(f"{where}.name {name!r} must be 1 to 256 characters without commas or spaces")
        if name in seen:
            raise SpecError(f"{where}.name {name!r} is used by an earlier adapter")
        if name == served_name:
            raise SpecError(f"{where}.name {name!r} is the served model's name")
        seen.add(name)
        scheme, _, rest = uri.partition("://")
        if scheme not in LORA_SCHEMES or not rest:
            raise SpecError(f"{where}.uri {uri!r} must start with pvc://, hf:// or file://")
        if scheme == "hf" and not HF_URI.match(uri):
            raise SpecError(f"{where}.uri {uri!r} must be hf://ORG/NAME or hf://ORG/NAME@REVISION")
        if scheme == "pvc" and "/" not in rest.strip("/"):
            raise SpecError(f"{where}.uri {uri!r} must be pvc://CLAIM/PATH")
        if scheme == "file" and not rest.startswith("/"):
            raise SpecError(f"{where}.uri {uri!r} must be file:///ABSOLUTE/PATH")
        adapters.append(LoRAAdapter(name, uri))
    max_rank = _int(get("model.lora.maxRank"), "spec.model.lora.maxRank", 1)
    if max_rank > 512:
        raise SpecError(f"spec.model.lora.maxRank must be 1 to 512, got {max_rank}")
    max_adapters = _int(get("model.lora.maxAdapters"), "spec.model.lora.maxAdapters", 1)
    if max_adapters > 64:
        raise SpecError(f"spec.model.lora.maxAdapters must be 1 to 64, got {max_adapters}")
    return LoRASpec(tuple(adapters), max_rank, max_adapters)


def _parse_cache(get) -> CacheSpec:
    claim, size = get("model.cache.claimName"), get("model.cache.size")
    if (claim is None) == (size is None):
        raise SpecError("spec.model.cache takes claimName (an existing PersistentVolumeClaim) or size (the "
                        "operator creates one), not both and not neither")
    mode = get("model.cache.accessMode")
    if mode is not None and mode not in CACHE_ACCESS_MODES:
        raise SpecError(f"spec.model.cache.accessMode must be one of {', '.join(CACHE_ACCESS_MODES)}, got {mode!r}")
    storage_class = get("model.cache.storageClassName")
    if claim is not None and (storage_class is not None or mode is not None):
        raise SpecError("spec.model.cache.storageClassName and accessMode describe a claim the operator "
                        "creates: they go with size, not claimName")
    return CacheSpec(
        claim_name=None if claim is None else _str(claim, "spec.model.cache.claimName"),
        size=None if size is None else _str(size, "spec.model.cache.size"),
        storage_class=None if storage_class is None else _str(storage_class, "spec.model.cache.storageClassName"),
        access_mode=mode,
    )


def _parse_routing(get) -> RoutingSpec:
    gateway = get("routing.gateway")
    if gateway is None:
        return RoutingSpec()
    if not isinstance(gateway, dict):
        raise SpecError("spec.routing.gateway must be an object with name (and optionally namespace)")
    ns = get("routing.gateway.namespace")
    return RoutingSpec(gateway_name=_str(get("routing.gateway.name"), "spec.routing.gateway.name"),
                       gateway_namespace=None if ns is None else _str(ns, "spec.routing.gateway.namespace"))


def _parse_scaling(get) -> ScalingSpec:
    lo = _int(get("scaling.minReplicas"), "spec.scaling.minReplicas", 0)
    hi = get("scaling.maxReplicas")
    if hi is None:
        raise SpecError("spec.scaling.maxReplicas is required")
    hi = _int(hi, "spec.scaling.maxReplicas", 1)
    if lo > hi:
        raise SpecError(f"spec.scaling.minReplicas {lo} is greater than maxReplicas {hi}")
    source = get("scaling.metrics.source")
    if source not in ("pods", "prometheus"):
        raise SpecError(f"spec.scaling.metrics.source must be pods or prometheus, got {source!r}")
    url = get("scaling.metrics.url")
    if source == "prometheus" and not url:
        raise SpecError("spec.scaling.metrics.url is required when source is prometheus")
    return ScalingSpec(
        min_replicas=lo,
        max_replicas=hi,
        target_queue_depth=_auto_or_int(get("scaling.targetQueueDepth"), "spec.scaling.targetQueueDepth"),
        scale_up_stabilization_seconds=_int(
            get("scaling.scaleUpStabilizationSeconds"), "spec.scaling.scaleUpStabilizationSeconds"),
        scale_down_stabilization_seconds=_int(
            get("scaling.scaleDownStabilizationSeconds"), "spec.scaling.scaleDownStabilizationSeconds"),
        metrics_source=source,
        prometheus_url=url,
        prometheus_query=get("scaling.metrics.query"),
        idle_seconds=_int(get("scaling.idleSeconds"), "spec.scaling.idleSeconds", 1),
    )
