"""Checks that a Secret a pod will read exists and has the key, before any pod is created (values
are never read: only the key names)."""

from tokenmill.operator.kube import KubeError


def secret_problem(api, namespace: str, secret: str, key: str, field: str) -> str | None:
    """None when the Secret has the key (or when reading Secrets is forbidden: the pod will then say
    so with CreateContainerConfigError); else a message naming the Secret, the field and the keys."""
    try:
        keys = api.secret_keys(namespace, secret)
    except KubeError as e:
        if e.status == 403:
            return None
        raise
    if keys is None:
        return f"Secret {secret} ({field}) not found in namespace {namespace}"
    if key not in keys:
        return f"Secret {secret} has no key {key!r} (keys: {', '.join(sorted(keys)) or 'none'})"
    return None
