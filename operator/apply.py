"""Writing the children: server-side apply when the live object drifted from the desired one."""


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
