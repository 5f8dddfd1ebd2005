"""The LeaderWorkerSet controller (sigs.k8s.io/lws) beside the local control plane.

e2e/build_lws.sh builds it from the Go module proxy and caches it with its CRD and webhook manifest.
Here: install the CRD, start the controller as a local process (recorded in the cluster's
cluster.json, so `cluster.py down` stops it by PID like the other components), and register its
admission webhooks. The controller cannot run without them: its pod webhook is what labels group pods
and injects LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX, and the worker StatefulSets are made
from those labels (ENABLE_WEBHOOKS=false would leave groups without workers). There is no in-cluster
Service for it (no kube-proxy), so the webhook configurations point at its local URL
(https://127.0.0.1:PORT/...), and its serving certificate is issued by the cluster's CA, which is the
caBundle. The controller's own cert rotation (internalCertManagement) is off: it would write a Secret and
patch caBundles for an in-cluster Service name.

    python e2e/lws_controller.py up [--workdir .e2e/pytest]
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import local_controllers
from cluster import (
    REPO,
    Cluster,
    _is_ours,
    _start,
    _state_path,
    _wait_until,
    free_port,
)
from pki import issue_serving_cert

BUILD_SCRIPT = REPO / "e2e" / "build_lws.sh"
NAME = "lws-controller"
# Only pods of LeaderWorkerSets go through its pod webhooks (upstream's manifest matches every pod, with
# failurePolicy Fail: a stopped controller would then block every pod in the cluster).
POD_SELECTOR = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}


def build() -> Path:
    """The cache folder (bin/lws-controller, crd/, webhook/), building it on first use."""
    return local_controllers.build(BUILD_SCRIPT, "the LWS controller")


def webhook_configurations(manifest: str, port: int, ca_pem: bytes) -> list[dict]:
    """Upstream's two webhook configurations pointed at the local URL; pod hooks only for LWS pods."""
    out = local_controllers.local_webhooks(manifest, "lws", port, ca_pem)
    for hook in (h for doc in out for h in doc["webhooks"]):
        if any("pods" in r.get("resources", []) for r in hook.get("rules", [])):
            hook["objectSelector"] = POD_SELECTOR
    return out


def install_crd(cluster: Cluster) -> Path:
    """Install the LeaderWorkerSet CRD (idempotent) and wait until it is served; returns the cache folder."""
    cache = build()
    crd = yaml.safe_load((cache / "crd" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml").read_text())
    local_controllers.apply_crds(cluster, [crd])
    return cache


def start(cluster: Cluster, timeout: float = 120.0) -> int:
    """Start (or find running) the controller for `cluster`; returns its PID."""
    state = json.loads(_state_path(cluster.workdir).read_text())
    running = state["processes"].get(NAME)
    if running and _is_ours(running["pid"], running["exe"]):
        return running["pid"]
    cache = install_crd(cluster)

    home = cluster.workdir / "lws"
    issue_serving_cert(cluster.workdir / "pki", home / "certs", "lws-webhook")
    webhook_port, health_port = free_port(), free_port()
    config = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(home / "certs")},
        "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
    }
    (home / "config.yaml").write_text(json.dumps(config, indent=2))
    argv = [str(cache / "bin" / NAME), f"--config={home / 'config.yaml'}", f"--kubeconfig={cluster.kubeconfig}"]
    proc = _start(cluster.workdir, state, NAME, argv)
    log = cluster.workdir / "logs" / f"{NAME}.log"

    def webhook_serves() -> bool:
        ctx = ssl.create_default_context(cafile=str(cluster.workdir / "pki" / "ca.crt"))
        with socket.create_connection(("127.0.0.1", webhook_port), timeout=2) as s, ctx.wrap_socket(
                s, server_hostname="127.0.0.1"):
            return True

    _wait_until(webhook_serves, "the LWS controller's webhook server", proc, log, timeout)
    hooks = webhook_configurations((cache / "webhook" / "manifests.yaml").read_text(), webhook_port,
                                   (cluster.workdir / "pki" / "ca.crt").read_bytes())
    local_controllers.apply_webhooks(cluster, hooks)
    return proc.pid


def main(argv: list[str] | None = None) -> int:
    return local_controllers.main(argv, "e2e/lws_controller.py", __doc__, NAME, build, start)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
