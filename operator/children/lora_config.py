"""spec.model.lora's ConfigMap: the adapters the engine pods serve, which they follow at run time.

The pods mount it (no subPath: the kubelet then swaps its files when it changes) and read it with
`tokenmill serve --lora-modules-file`: adapters added, changed or removed here are loaded or unloaded by
every running engine within the kubelet's sync period, and no pod restarts, because the pod template
holds only the file's path. (The other way considered, the operator calling each pod's
/v1/load_lora_adapter, needs the pods' API key and leaves a new or restarted pod without its adapters
until the next reconcile; the file is there before the engine reports ready.)
"""

import json

from tokenmill.operator.children.meta import child_metadata, stamp
from tokenmill.operator.children.model_source import MODELS_DIR
from tokenmill.operator.plan.sizing import CPU_LORAS_PER_SLOT
from tokenmill.operator.plan.spec import ServiceSpec

LORA_DIR = "/etc/tokenmill/lora"
LORA_FILE = "adapters.json"
LORA_VOLUME = "lora-adapters"
SUFFIX = "-lora-adapters"


def lora_config_name(spec: ServiceSpec) -> str:
    return f"{spec.name}{SUFFIX}"


def adapters_json(spec: ServiceSpec) -> str:
    """The engine's --lora-modules-file: vLLM's JSON form per adapter, the URI as written (the engine reads
    hf://, pvc:// and file:// as it reads --model)."""
    return json.dumps([{"name": a.name, "path": a.uri} for a in spec.lora.adapters], indent=1) + "\n"


def desired_lora_config(spec: ServiceSpec) -> dict | None:
    if spec.lora is None:
        return None
    meta = {**child_metadata(spec), "name": lora_config_name(spec)}
    return stamp({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {LORA_FILE: adapters_json(spec)}})


def lora_engine_args(spec: ServiceSpec) -> list[str]:
    """The engine's LoRA flags: what sizes it (a change restarts the pods), never the adapters themselves."""
    if spec.lora is None:
        return []
    lora = spec.lora
    return [
        "--lora-modules-file", f"{LORA_DIR}/{LORA_FILE}",
        "--max-loras", str(lora.max_adapters),
        "--max-lora-rank", str(lora.max_rank),
        # (the engine answers 429 only when more adapters than this have requests in flight)
        "--max-cpu-loras", str(CPU_LORAS_PER_SLOT * lora.max_adapters),
    ]


def lora_volumes(spec: ServiceSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the ConfigMap, and the claims of pvc:// adapters the model's own claim is not."""
    if spec.lora is None:
        return [], []
    vols = [{"name": LORA_VOLUME, "configMap": {"name": lora_config_name(spec)}}]
    mounts = [{"name": LORA_VOLUME, "mountPath": LORA_DIR, "readOnly": True}]
    model_claim = spec.model_path.partition("/")[0] if spec.model_scheme == "pvc" else None
    claims = sorted({a.uri.removeprefix("pvc://").partition("/")[0] for a in spec.lora.adapters
                     if a.uri.startswith("pvc://")} - {model_claim})  # fmt: skip
    for i, claim in enumerate(claims):
        vols.append({"name": f"lora-claim-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"lora-claim-{i}", "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True})
    return vols, mounts
