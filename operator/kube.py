"""A small Kubernetes REST client over the official client's connection handling.

Objects are plain dicts in and out (the API's own JSON), so desired-state dicts apply as they are and
tests can stand in a dict-backed fake with the same methods. Credentials: $KUBECONFIG when set (how e2e
runs the operator as a local process with a ServiceAccount token), else the in-cluster ServiceAccount,
else ~/.kube/config.
"""

import base64
import datetime
import json
import os
import socket
from urllib.parse import quote

from tokenmill.operator.plan.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = "tokenmill-operator"

# kind -> (API prefix, plural)
RESOURCES = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "Service": ("/api/v1", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Pod": ("/api/v1", "pods"),
    "ResourceQuota": ("/api/v1", "resourcequotas"),
    "Secret": ("/api/v1", "secrets"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Event": ("/api/v1", "events"),
    # The router of a routed service (spec.routing): the endpoint picker's ServiceAccount, RoleBinding and
    # ConfigMap; its InferencePool; the HTTPRoute and (read only) the Gateway it attaches to.
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("/apis/gateway.networking.k8s.io/v1", "httproutes"),
    "Gateway": ("/apis/gateway.networking.k8s.io/v1", "gateways"),
    "InferenceService": (f"/apis/{GROUP}/{VERSION}", PLURAL),
    # Kueue (read only): the queue a service names, its ClusterQueue (cluster-scoped), the Workloads of its pods.
    "LocalQueue": ("/apis/kueue.x-k8s.io/v1beta2", "localqueues"),
    "ClusterQueue": ("/apis/kueue.x-k8s.io/v1beta2", "clusterqueues"),
    "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads"),
    # Kopf's peering objects: read by the per-object loops to pause with Kopf (leadership.py).
    "KopfPeering": ("/apis/kopf.dev/v1", "kopfpeerings"),
    "ClusterKopfPeering": ("/apis/kopf.dev/v1", "clusterkopfpeerings"),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def path(kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    """The REST path; namespace None for cluster-scoped kinds."""
    prefix, plural = RESOURCES[kind]
    out = f"{prefix}/{plural}" if namespace is None else f"{prefix}/namespaces/{quote(namespace)}/{plural}"
    if name is not None:
        out += f"/{quote(name)}"
    if sub is not None:
        out += f"/{sub}"
    return out


def load_config():
    """kubernetes.client.ApiClient with the credentials described in the module docstring."""
    import kubernetes

    if os.environ.get("KUBECONFIG"):
        kubernetes.config.load_kube_config()
    else:
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


class KubeApi:
    def __init__(self, api_client=None, timeout: float = 30.0):
        self.api_client = api_client if api_client is not None else load_config()
        self.timeout = timeout

    def request(self, method: str, url_path: str, body=None, query=None, content_type: str | None = None):
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        method, url, headers, body, _ = self.api_client.param_serialize(
            method=method, resource_path=url_path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )
        rsp = self.api_client.call_api(method, url, header_params=headers, body=body, _request_timeout=self.timeout)
        data = rsp.read()
        if rsp.status == 404 and method in ("GET", "DELETE"):
            return None
        if rsp.status >= 400:
            try:
                message = json.loads(data).get("message", "")
            except ValueError:
                message = data[:500].decode(errors="replace") if data else ""
            raise KubeError(rsp.status, f"{method} {url_path}: {message}")
        return json.loads(data) if data else None

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self.request("GET", path(kind, namespace, name))

    def list(self, kind: str, namespace: str, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict]:
        query = [("labelSelector", label_selector)] if label_selector else []
        if field_selector:
            query.append(("fieldSelector", field_selector))
        return (self.request("GET", path(kind, namespace), query=query) or {}).get("items") or []

    def apply(self, obj: dict, field_manager: str = FIELD_MANAGER) -> dict:
        """Server-side apply with force: fields we set are ours, others' fields are left alone."""
        meta = obj["metadata"]
        return self.request(
            "PATCH", path(obj["kind"], meta["namespace"], meta["name"]), body=json.dumps(obj),
            query=[("fieldManager", field_manager), ("force", "true")], content_type="application/apply-patch+yaml",
        )

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.request("DELETE", path(kind, namespace, name))

    def patch_status(self, namespace: str, name: str, patch: dict) -> dict:
        return self.request(
            "PATCH", path("InferenceService", namespace, name, "status"), body={"status": patch},
            content_type="application/merge-patch+json",
        )

    def secret_keys(self, namespace: str, name: str) -> set[str] | None:
        """Keys of a Secret (never its values), None when it does not exist. Raises KubeError 403 when
        the operator may not read Secrets here."""
        secret = self.get("Secret", namespace, name)
        if secret is None:
            return None
        return set((secret.get("data") or {}).keys()) | set((secret.get("stringData") or {}).keys())

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One value of a Secret (the Hugging Face token the operator's hub lookups send), None when the
        Secret or the key is missing. Never logged nor written to status."""
        secret = self.get("Secret", namespace, name)
        if secret is None:
            return None
        if key in (secret.get("stringData") or {}):
            return secret["stringData"][key]
        raw = (secret.get("data") or {}).get(key)
        return None if raw is None else base64.b64decode(raw).decode().strip()

    def create_event(self, obj: dict, type_: str, reason: str, message: str) -> None:
        meta = obj.get("metadata") or {}
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": socket.gethostname(),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.request("POST", path("Event", meta.get("namespace")), body=event)

    def has_resource(self, group: str, version: str, plural: str) -> bool:
        found = self.request("GET", f"/apis/{group}/{version}")
        return any(r.get("name") == plural for r in (found or {}).get("resources") or [])


def merge_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: changed keys, None for removed."""
    patch = {}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            sub = merge_patch(old[key], value)
            if sub:
                patch[key] = sub
        elif old.get(key) != value or key not in old:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch
