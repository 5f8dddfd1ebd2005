"""Kueue's controller manager (sigs.k8s.io/kueue) beside the local control plane.

e2e/build_kueue.sh builds it from the Go module proxy and caches it with its CRDs and webhook manifest.
Here: start the LeaderWorkerSet controller first (Kueue's LWS integration needs the LWS CRD served; without
it Kueue defers that integration and polls with a back-off of up to 2 minutes), install Kueue's CRDs, start
Kueue as a local process (recorded in the cluster's cluster.json, so `cluster.py down` stops it by PID),
wait for its /readyz, register its admission webhooks at its local URL (local_controllers.py), and check
with a server-side dry run that its Deployment webhook now labels a queued Deployment's pod template.

What differs from upstream's install (config/default) and why:
- internalCertManagement off and leader election off: the webhook serving cert is issued by the cluster's
  CA (the caBundle) instead of a Secret rotated for an in-cluster Service name; one replica.
- The metrics server's cert is read from a path fixed in cmd/kueue/main.go, /etc/kueue/metrics/certs,
  whenever internalCertManagement is off; a self-signed pair is written there once per machine if it is
  missing (metrics_certs), and the metrics server listens on 127.0.0.1 on a free port.
- The visibility server (feature gate VisibilityOnDemand) is off: it would bind 0.0.0.0:8082 (two clusters
  on one machine would collide), and its API can only be reached through an APIService backed by a
  Service, which this cluster cannot route to.
- Integrations: batch/job, pod, deployment, statefulset and leaderworkerset (the built-in default is only
  batch/job).

    python e2e/kueue_controller.py up [--workdir .e2e]
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import local_controllers
import lws_controller
from cluster import (
    REPO,
    Cluster,
    ClusterError,
    _http_ok,
    _is_ours,
    _start,
    _state_path,
    _wait_until,
    free_port,
)
from pki import issue_serving_cert

BUILD_SCRIPT = REPO / "e2e" / "build_kueue.sh"
NAME = "kueue"
INTEGRATIONS = ("batch/job", "pod", "deployment", "statefulset", "leaderworkerset.x-k8s.io/leaderworkerset")
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
# Upstream's kustomization (config/components/webhook) puts this selector on every webhook of a workload
# type, so that Kueue never blocks the system namespaces' pods; its own types' webhooks have none.
NAMESPACE_SELECTOR = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                            "values": ["kube-system", "kueue-system"]}]}
OWN_GROUP = "kueue.x-k8s.io"


def build() -> Path:
    """The cache folder (bin/kueue, crd/, webhook/), building it on first use."""
    return local_controllers.build(BUILD_SCRIPT, "Kueue")


def crds(cache: Path, port: int, ca_pem: bytes) -> list[dict]:
    """Upstream's CRD bases, with the conversion webhook (v1beta1 <-> v1beta2) that upstream's
    config/components/crd kustomization patches in, pointed at the local URL."""
    out = {}
    for path in sorted((cache / "crd").glob(f"{OWN_GROUP}_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        out[crd["metadata"]["name"]] = crd
    # Only the patches the kustomization lists (uncommented): resourceflavors has none.
    listed = re.findall(r"^- path: (patches/webhook_in_\w+\.yaml)$",
                        (cache / "crd" / "kustomization.yaml").read_text(), re.MULTILINE)
    for patch_path in listed:
        patch = yaml.safe_load((cache / "crd" / patch_path).read_text())
        conversion = patch["spec"]["conversion"]
        conversion["webhook"]["clientConfig"] = local_controllers.local_url(
            port, conversion["webhook"]["clientConfig"]["service"]["path"], ca_pem)
        out[patch["metadata"]["name"]]["spec"]["conversion"] = conversion
    return list(out.values())


def webhook_configurations(manifest: str, port: int, ca_pem: bytes) -> list[dict]:
    """Upstream's two webhook configurations pointed at the local URL, with upstream's namespace selector."""
    out = local_controllers.local_webhooks(manifest, "kueue", port, ca_pem)
    for hook in (h for doc in out for h in doc["webhooks"]):
        if not any(OWN_GROUP in r.get("apiGroups", []) for r in hook.get("rules", [])):
            hook["namespaceSelector"] = NAMESPACE_SELECTOR
    return out


def metrics_certs(certs: Path = METRICS_CERTS) -> None:
    """Write a self-signed tls.crt/tls.key where cmd/kueue/main.go reads them, unless both exist already
    (another cluster on this machine, or a real install, made them: they are left alone)."""
    from pki import _issue, _name, make_ca

    try:
        certs.mkdir(parents=True, exist_ok=True)
        # One writer at a time: two clusters starting together must not leave one's key beside the
        # other's certificate.
        with open(certs.parent / ".tokenmill-e2e.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (certs / "tls.crt").exists() and (certs / "tls.key").exists():
                return
            ca_key, ca_cert = make_ca("kueue-metrics-e2e", days=3650)
            crt, key = _issue(ca_key, ca_cert, _name("kueue-metrics"), server_names=["127.0.0.1", "localhost"],
                              days=3650)
            for name, data, mode in (("tls.key", key, 0o600), ("tls.crt", crt, 0o644)):
                tmp = certs / f".{name}.tmp"
                tmp.write_bytes(data)
                tmp.chmod(mode)
                tmp.replace(certs / name)
    except OSError as e:
        raise ClusterError(f"Kueue reads its metrics serving certificate from {certs}/tls.crt and "
                           f"tls.key (fixed in cmd/kueue/main.go when internalCertManagement is off), and "
                           f"they could not be written there ({e}); create them once as root") from None


def configuration(home: Path, webhook_port: int, metrics_port: int, health_port: int) -> dict:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(home / "certs")},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "integrations": {"frameworks": list(INTEGRATIONS)},
        "featureGates": {"VisibilityOnDemand": False},
    }


def _deployment_webhook_mutates(cluster: Cluster) -> bool:
    """A server-side dry run of a queued Deployment: Kueue's webhook labels its pod template."""
    probe = {"apiVersion": "apps/v1", "kind": "Deployment",
             "metadata": {"name": "kueue-webhook-probe", "namespace": "default",
                          "labels": {"kueue.x-k8s.io/queue-name": "probe"}},
             "spec": {"selector": {"matchLabels": {"app": "probe"}},
                      "template": {"metadata": {"labels": {"app": "probe"}},
                                   "spec": {"containers": [{"name": "c", "image": "probe"}]}}}}
    proc = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(probe),
                           check=False)
    if proc.returncode != 0:
        return False
    labels = json.loads(proc.stdout)["spec"]["template"]["metadata"].get("labels", {})
    return labels.get("kueue.x-k8s.io/managed") == "true"


def start(cluster: Cluster, timeout: float = 120.0) -> int:
    """Start (or find running) Kueue, and the LWS controller before it, for `cluster`; returns Kueue's PID."""
    lws_controller.start(cluster, timeout)
    state = json.loads(_state_path(cluster.workdir).read_text())
    running = state["processes"].get(NAME)
    if running and _is_ours(running["pid"], running["exe"]):
        return running["pid"]
    cache = build()
    metrics_certs()

    home = cluster.workdir / "kueue"
    ca_pem = (cluster.workdir / "pki" / "ca.crt").read_bytes()
    issue_serving_cert(cluster.workdir / "pki", home / "certs", "kueue-webhook")
    webhook_port, metrics_port, health_port = free_port(), free_port(), free_port()
    local_controllers.apply_crds(cluster, crds(cache, webhook_port, ca_pem))
    (home / "config.yaml").write_text(json.dumps(configuration(home, webhook_port, metrics_port, health_port),
                                                 indent=2))
    argv = [str(cache / "bin" / NAME), f"--config={home / 'config.yaml'}", f"--kubeconfig={cluster.kubeconfig}"]
    proc = _start(cluster.workdir, state, NAME, argv)
    log = cluster.workdir / "logs" / f"{NAME}.log"
    # /readyz turns 200 once the webhook server listens (cmd/kueue/main.go, setupProbeEndpoints).
    _wait_until(lambda: _http_ok(f"http://127.0.0.1:{health_port}/readyz"), "Kueue's /readyz", proc, log, timeout)
    local_controllers.apply_webhooks(
        cluster, webhook_configurations((cache / "webhook" / "manifests.yaml").read_text(), webhook_port, ca_pem))
    # The API server picks up new webhook configurations asynchronously.
    _wait_until(lambda: _deployment_webhook_mutates(cluster), "Kueue's Deployment webhook", proc, log, timeout)
    return proc.pid


def main(argv: list[str] | None = None) -> int:
    return local_controllers.main(argv, "e2e/kueue_controller.py", __doc__, NAME, build, start)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
