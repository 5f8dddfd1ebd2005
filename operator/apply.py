"""Writing the children: server-side apply of each one that drifted from its desired state, deletion of
those no longer wanted, and an event for each object created, resized or replaced.

Only what our desired state sets is compared (differs), so fields the API server defaults or others set
do not cause writes; a steady state writes nothing.
"""

import logging
from dataclasses import dataclass

from tokenmill.operator.children.desired import Desired
from tokenmill.operator.children.leaderworkerset import KIND as LWS_KIND
from tokenmill.operator.children.leaderworkerset import as_deployment
from tokenmill.operator.children.lora_config import lora_config_name
from tokenmill.operator.children.meta import is_owned_by
from tokenmill.operator.children.model_source import CACHE_CLAIM_SUFFIX
from tokenmill.operator.observe.cluster import Live
from tokenmill.operator.observe.router import ROUTER_KINDS, RouterLive, router_child_name
from tokenmill.operator.plan.spec import ServiceSpec

log = logging.getLogger("tokenmill.operator")

Event = tuple[str, str, str]  # (type, reason, message)


@dataclass(frozen=True, slots=True)
class Applied:
    workload: dict  # the workload after this pass, in a Deployment's shape (as_deployment)
    spec_changed: bool  # more than its replicas changed (or it is new): a rollout, not only a scale
    scaled: bool  # an existing workload's replicas changed


def apply_children(api, spec: ServiceSpec, desired: Desired, live: Live, why: str, events: list[Event]) -> Applied:
    """`why`: the reason a change of size gives in its event. Events are appended to `events`."""
    apply_cache_claim(api, spec, desired.cache_claim, events)
    apply_lora_config(api, spec, desired.lora_config, events)  # before the pods that mount it
    applied = _apply_workload(api, desired, live, why, events)
    # A plan that moved between one node and several: the other workload kind goes once the new one exists.
    other = "Deployment" if live.multi_node else LWS_KIND
    old = live.objects.get(other)
    if old is not None and other not in live.foreign:
        api.delete(other, spec.namespace, old["metadata"]["name"])
        replaced = f"{other} {old['metadata']['name']}: replaced by {_name(desired.workload)}"
        events.append(("Normal", "Deleted", replaced))
    for kind, want in (("Service", desired.service), ("PodDisruptionBudget", desired.pdb)):
        if want is None:
            if live.objects[kind] is not None:
                api.delete(kind, spec.namespace, spec.name)
        elif live.objects[kind] is None or differs(want, live.objects[kind]):
            api.apply(want)
            if live.objects[kind] is None:
                events.append(("Normal", "Created", f"{kind} {spec.name}"))
    apply_router(api, spec, desired.router, live.router, events)
    return applied


def apply_router(api, spec: ServiceSpec, want: list[dict], live: RouterLive, events: list[Event]) -> None:
    """The router's children (spec.routing) in order; those no longer wanted (routing turned off, or a
    Gateway named instead of the standalone Envoy) are deleted."""
    wanted = {obj["kind"] for obj in want}
    for obj in want:
        old = live.objects.get(obj["kind"])
        if old is not None and obj["kind"] == "RoleBinding" and old.get("roleRef") != obj["roleRef"]:
            api.delete("RoleBinding", spec.namespace, obj["metadata"]["name"])  # roleRef is immutable
            old = None
        if old is None or differs(obj, old):
            api.apply(obj)
            if old is None:
                events.append(("Normal", "Created", _name(obj)))
    for kind in ROUTER_KINDS:
        if kind in live.objects and kind not in wanted:
            api.delete(kind, spec.namespace, router_child_name(spec, kind))
            events.append(("Normal", "Deleted", f"{kind} {router_child_name(spec, kind)}: routing is off"
                           if spec.routing is None else f"{kind} {router_child_name(spec, kind)}: no longer used"))


def _name(obj: dict) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


def _apply_workload(api, desired: Desired, live: Live, why: str, events: list[Event]) -> Applied:
    want, workload, current = desired.workload, live.workload, live.current
    replicas = want["spec"]["replicas"]
    spec_changed = workload is None or differs({**want["spec"], "replicas": None},
                                               {**workload.get("spec", {}), "replicas": None})
    scaled = False
    if workload is None:
        workload = as_deployment(want["kind"], api.apply(want))
        events.append(("Normal", "Created", f"{_name(want)}: {desired.summary}"))
    elif differs(want, workload):
        if current is not None and current != replicas:
            events.append(("Normal", "ScaledUp" if replicas > current else "ScaledDown",
                           f"{_name(want)} from {current} to {replicas} replicas: {why}"))
            scaled = True
        workload = as_deployment(want["kind"], api.apply(want))
    return Applied(workload, spec_changed, scaled)


def apply_lora_config(api, spec: ServiceSpec, want: dict | None, events: list[Event]) -> None:
    """spec.model.lora's ConfigMap: written when it drifts (the engines follow it: no rollout). Without
    spec.model.lora it is not looked at (no read per reconcile of every service): one left by a spec that
    dropped its lora goes with the InferenceService (owner reference), unread by its pods."""
    if want is None:
        return
    name = lora_config_name(spec)
    live = api.get("ConfigMap", spec.namespace, name)
    if live is None or differs(want, live):
        api.apply(want)
        adapters = ", ".join(a.name for a in spec.lora.adapters) or "none"
        events.append(("Normal", "Created" if live is None else "Updated", f"ConfigMap {name}: LoRA adapters {adapters}"))


def apply_cache_claim(api, spec: ServiceSpec, want: dict | None, events: list[Event]) -> None:
    """The model cache PVC of an hf:// model (children/cache_pvc.py), deleted again when the spec names a
    claim or drops the cache. A claim's class and access mode cannot change once created: such an edit is
    logged and left alone; only a larger size is applied (volume expansion)."""
    if spec.model_scheme != "hf":
        return
    name = f"{spec.name}{CACHE_CLAIM_SUFFIX}"
    live = api.get("PersistentVolumeClaim", spec.namespace, name)
    if want is None:
        if live is not None and is_owned_by(live, spec):
            api.delete("PersistentVolumeClaim", spec.namespace, name)
        return
    if live is None:
        api.apply(want)
        events.append(("Normal", "Created", f"PersistentVolumeClaim {name} ({spec.cache.size}) for the model cache"))
    elif is_owned_by(live, spec) and differs(want, live):
        fixed = {k: v for k, v in want["spec"].items() if k != "resources"}
        if differs(fixed, live.get("spec") or {}):
            log.warning("%s/%s: PersistentVolumeClaim %s keeps its storage class and access mode (immutable); "
                        "delete it to recreate it", spec.namespace, spec.name, name)
        else:
            api.apply(want)


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
