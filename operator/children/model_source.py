"""The pod's side of spec.model: the engine's --model, the volumes the weights come from, the model
cache that hf:// downloads go to, and the Hub environment (token, endpoint).

Who downloads: the engine itself, at start, into HF_HOME on the cache volume (no init container). The
engine's model source fetches only the files it loads, resumes a cut download and skips what the cache
holds, so a second replica or a restart on a shared cache reads the weights without downloading them
again. The startup probe's budget includes the download (plan/startup.py's startup_timeout_seconds). The claim
the operator creates for the cache is cache_pvc.py's.
"""

from tokenmill.operator.plan.spec import ServiceSpec

MODELS_DIR = "/models"  # pvc:// claims are mounted at MODELS_DIR/CLAIM, read-only
MODEL_CACHE_DIR = "/model-cache"  # the cache volume; HF_HOME is MODEL_CACHE_DIR/huggingface
HF_HOME = f"{MODEL_CACHE_DIR}/huggingface"
CACHE_CLAIM_SUFFIX = "-model-cache"


def model_argument(spec: ServiceSpec) -> str:
    """What --model gets: the URI as written. The engine (engine/model/source.py) reads every scheme:
    pvc://CLAIM/PATH as MODELS_DIR/CLAIM/PATH, where volumes() mounts the claim; hf:// with its
    @REVISION from the Hub into HF_HOME; file:// and bundled:// from the image."""
    return spec.model_uri


def cache_claim_name(spec: ServiceSpec) -> str | None:
    """The PVC the cache lives on: the user's, the one the operator creates, or None (emptyDir)."""
    if spec.cache is None:
        return None
    return spec.cache.claim_name or f"{spec.name}{CACHE_CLAIM_SUFFIX}"


def volumes(spec: ServiceSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, the engine container's mounts) for the model: its pvc:// claim and the cache."""
    claim = cache_claim_name(spec)
    cache = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    vols = [{"name": "model-cache", **cache}]
    mounts = [{"name": "model-cache", "mountPath": MODEL_CACHE_DIR}]
    if spec.model_scheme == "pvc":
        source = spec.model_path.partition("/")[0]
        mounts.append({"name": "model", "mountPath": f"{MODELS_DIR}/{source}", "readOnly": True})
        vols.append({"name": "model", "persistentVolumeClaim": {"claimName": source, "readOnly": True}})
    return vols, mounts


def env(spec: ServiceSpec, hf_endpoint: str | None) -> list[dict]:
    out = [{"name": "HF_HOME", "value": HF_HOME}]
    if hf_endpoint:
        out.append({"name": "HF_ENDPOINT", "value": hf_endpoint})
    if spec.token_secret is not None:
        name, key = spec.token_secret
        out.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    return out
