"""GPU ResourceQuota headroom: how many replicas fit before the API server would refuse their pods.

ResourceQuota is enforced when a pod is admitted, after an autoscaler has decided; a Deployment scaled
past it sits with pods that cannot be created. So the operator reads the quotas first and caps.
"""

import re
from dataclasses import dataclass
from fractions import Fraction

from tokenmill.operator.plan.catalog import GPU_RESOURCE

# Quota keys that limit GPUs. The API server accepts only the requests. form for extended resources;
# the other two are read too so that a quota written either way is never ignored.
GPU_QUOTA_KEYS = (f"requests.{GPU_RESOURCE}", f"limits.{GPU_RESOURCE}", GPU_RESOURCE)

_SUFFIX = {
    "": 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+)?([a-zA-Z]*)$")


def parse_quantity(value: object) -> Fraction:
    """A Kubernetes quantity ("4", "500m", "1Gi", "1e3") as an exact number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Fraction(value)
    m = _QUANTITY.match(str(value).strip())
    if not m or m.group(3) not in _SUFFIX:
        raise ValueError(f"not a quantity: {value!r}")
    number = Fraction(m.group(1))
    if m.group(2):
        number *= Fraction(10) ** int(m.group(2)[1:])
    return number * _SUFFIX[m.group(3)]


def pod_gpus(pod: dict) -> int:
    """nvidia.com/gpu a pod is charged for: its containers' requests (extended resources default their
    request to the limit), or the largest init container's if that is larger."""
    spec = pod.get("spec") or {}

    def of(container: dict) -> int:
        res = container.get("resources") or {}
        value = (res.get("requests") or {}).get(GPU_RESOURCE, (res.get("limits") or {}).get(GPU_RESOURCE, 0))
        return int(parse_quantity(value))

    main = sum(of(c) for c in spec.get("containers") or [])
    init = max((of(c) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def pod_counts_against_quota(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def quota_applies(quota: dict, priority_class: str | None) -> bool:
    """Whether a quota's scopes select the engine pods (not terminating, not best-effort, no
    cross-namespace affinity; PriorityClass as given)."""
    spec = quota.get("spec") or {}
    for scope in spec.get("scopes") or []:
        if scope in ("Terminating", "BestEffort", "CrossNamespacePodAffinity"):
            return False
        if scope == "PriorityClass" and priority_class is None:
            return False
    for expr in (spec.get("scopeSelector") or {}).get("matchExpressions") or []:
        scope, op, values = expr.get("scopeName"), expr.get("operator"), expr.get("values") or []
        if scope == "PriorityClass":
            if op == "In" and priority_class not in values:
                return False
            if op == "NotIn" and priority_class in values:
                return False
            if op == "Exists" and priority_class is None:
                return False
            if op == "DoesNotExist" and priority_class is not None:
                return False
        elif scope in ("Terminating", "BestEffort", "CrossNamespacePodAffinity") and op != "DoesNotExist":
            return False
    return True


@dataclass(frozen=True, slots=True)
class QuotaCap:
    max_replicas: int | None  # None: no quota limits GPUs here
    limited: bool  # the wanted replicas do not fit
    message: str


def cap_replicas(
    wanted: int, gpus_per_replica: int, quotas: list[dict], own_pods: list[dict], priority_class: str | None = None
) -> QuotaCap:
    """The most replicas (up to `wanted`) that every applicable GPU quota admits.

    Headroom counts this service's own pods as available to it: they are in the quota's `used`, and
    scaling to N replaces them rather than adds to them (the Deployment does not surge).
    """
    own = sum(pod_gpus(p) for p in own_pods if pod_counts_against_quota(p))
    best: tuple[int, str] | None = None
    for quota in quotas:
        if not quota_applies(quota, priority_class):
            continue
        status = quota.get("status") or {}
        hard_map = status.get("hard") or (quota.get("spec") or {}).get("hard") or {}
        used_map = status.get("used") or {}
        for key in GPU_QUOTA_KEYS:
            if key not in hard_map:
                continue
            hard = int(parse_quantity(hard_map[key]))
            # The quota controller recounts `used` after pods appear, so a fresh status may not hold our
            # newest pods yet (seen: used 0 with our 2 pods running, and a third replica refused). What
            # this service's own live pods take is a floor for it.
            used = max(int(parse_quantity(used_map.get(key, 0))), own)
            headroom = max(0, hard - used + own)
            fits = headroom // gpus_per_replica
            name = (quota.get("metadata") or {}).get("name", "?")
            text = (
                f"ResourceQuota {name} ({key}: hard {hard}, used {used} of which {own} by this service) "
                f"admits {fits} replicas x {gpus_per_replica} GPUs"
            )
            if best is None or fits < best[0]:
                best = (fits, text)
    if best is None:
        return QuotaCap(None, False, f"no ResourceQuota limits {GPU_RESOURCE} for these pods")
    fits, text = best
    if fits < wanted:
        return QuotaCap(fits, True, f"{text}; wanted {wanted}: capped at {fits}")
    return QuotaCap(fits, False, f"{text}; {wanted} fit")
