"""What the controllers that run beside the local control plane as local processes share (the LWS
controller, Kueue): their cached build, their CRDs, and their admission webhooks pointed at 127.0.0.1.

There is no in-cluster Service for them (no kube-proxy), so every webhook's `clientConfig.service` becomes
`url: https://127.0.0.1:PORT<path>` and the cluster's CA (which issued the controller's serving cert,
pki.issue_serving_cert) is the caBundle, as controller-runtime's envtest does for Kueue's and LWS's own
integration tests.
"""

from __future__ import annotations

import argparse
import base64
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from cluster import REPO, Cluster, ClusterError, load_cluster


def build(script: Path, what: str) -> Path:
    """The cache folder printed by `script` (a build_*.sh), building on first use."""
    t0 = time.monotonic()
    if subprocess.run(["bash", str(script), "--check"], capture_output=True).returncode != 0:
        print(f"[e2e] building {what} (`bash {script.relative_to(REPO)}`; minutes on a cold cache)", file=sys.stderr)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"building {what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}\n"
                           f"Re-run `bash {script.relative_to(REPO)}` to retry.")
    if time.monotonic() - t0 > 30:
        print(f"[e2e] {what} built in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return Path(proc.stdout.strip().splitlines()[-1])


def apply_crds(cluster: Cluster, crds: list[dict], timeout: float = 60.0) -> None:
    """Apply CRDs (idempotent) and wait until every one is Established."""
    # Server-side: these CRDs (full pod templates) are larger than client-side apply's annotation limit.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": crds}))
    deadline = time.monotonic() + timeout
    for crd in crds:
        name = crd["metadata"]["name"]
        # `kubectl wait` fails outright while a new CRD has no status.conditions yet: poll instead.
        while cluster.kubectl("get", f"crd/{name}", "-o",
                              "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                              check=False).stdout != "True":
            if time.monotonic() > deadline:
                raise ClusterError(f"the CRD {name} was not Established after {timeout:.0f}s")
            time.sleep(0.5)


def local_url(port: int, path: str, ca_pem: bytes) -> dict:
    """A webhook clientConfig for a controller listening on 127.0.0.1:port."""
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": base64.b64encode(ca_pem).decode()}


def local_webhooks(manifest: str, prefix: str, port: int, ca_pem: bytes) -> list[dict]:
    """Upstream's webhook configurations (config/webhook/manifests.yaml, before kustomize), named
    `<prefix>-<name>` as upstream's kustomize namePrefix does, each service reference replaced by the
    local URL."""
    out = []
    for doc in yaml.safe_load_all(manifest):
        if not doc:
            continue
        doc["metadata"]["name"] = f"{prefix}-{doc['metadata']['name']}"
        for hook in doc["webhooks"]:
            hook["clientConfig"] = local_url(port, hook["clientConfig"]["service"]["path"], ca_pem)
        out.append(doc)
    return out


def apply_webhooks(cluster: Cluster, configurations: list[dict]) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({"apiVersion": "v1", "kind": "List",
                                                               "items": configurations}))


def main(argv: list[str] | None, script: str, doc: str, name: str, build: Callable[[], Path],
         start: Callable[[Cluster], int]) -> int:
    """The command line of e2e/<controller>.py: `up` (start it on a running cluster) or `build`."""
    parser = argparse.ArgumentParser(prog=script, description=doc.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "build"])
    parser.add_argument("--workdir", type=Path, default=REPO / ".e2e")
    args = parser.parse_args(argv)
    try:
        if args.action == "build":
            print(build())
        else:
            print(f"{name} pid {start(load_cluster(args.workdir))}")
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
