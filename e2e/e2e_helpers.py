"""Small helpers shared by the e2e tests: polling, reading objects, a ServiceAccount kubeconfig, and the
operator as a local process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from cluster import REPO, Cluster, free_port
from pki import kubeconfig_yaml

T = TypeVar("T")
CHART = REPO / "charts" / "tokenmill-operator"
EXAMPLES = REPO / "examples"
ISVC = "inferenceservices.serving.tokenmill.dev"
OPERATOR_NAMESPACE = "tokenmill-system"  # where the e2e session installs the chart
RELEASE = "tokenmill-operator"  # contains the chart name, so the chart's objects are named just this


def wait_for(check: Callable[[], T], what: str, timeout: float = 60, interval: float = 0.5) -> T:
    """Poll until `check` returns something truthy; fail naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}"[:4000])
        time.sleep(interval)


def get(cluster: Cluster, kind: str, name: str | None = None, namespace: str | None = None) -> dict | None:
    args = ["get", kind, *([name] if name else []), "-o", "json"]
    if namespace:
        args += ["-n", namespace]
    proc = cluster.kubectl(*args, check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            return None
        raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
    return json.loads(proc.stdout)


def items(cluster: Cluster, kind: str, namespace: str, selector: str | None = None) -> list[dict]:
    args = ["get", kind, "-n", namespace, "-o", "json", *(["-l", selector] if selector else [])]
    return json.loads(cluster.kubectl(*args).stdout)["items"]


def condition(obj: dict | None, type_: str) -> dict | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def is_current(obj: dict | None) -> bool:
    """Status written for the object's current generation."""
    return bool(obj) and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]


def ready_for_current_generation(obj: dict | None) -> bool:
    ready = condition(obj, "Ready")
    return is_current(obj) and ready is not None and ready["status"] == "True" and \
        ready.get("observedGeneration", obj["metadata"]["generation"]) == obj["metadata"]["generation"]


def apply(cluster: Cluster, manifest: dict | str, namespace: str | None = None,
          check: bool = True) -> subprocess.CompletedProcess:
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    args = ["apply", "-f", "-", *(["-n", namespace] if namespace else [])]
    return cluster.kubectl(*args, input=text, check=check)



def prebound_volume(cluster: Cluster, namespace: str, claim: str) -> str:
    """A PersistentVolume bound ahead to the claim the operator will create (there is no storage
    provisioner here); the pod runner gives every claim one folder. Returns the volume's name."""
    pv = f"{namespace}-model-cache"
    apply(cluster, {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                    "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"],
                             "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                             "hostPath": {"path": f"/tmp/{pv}"}, "claimRef": {"namespace": namespace, "name": claim}}})
    return pv

def sa_kubeconfig(cluster: Cluster, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount (a bound token from the TokenRequest API)."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").stdout.strip()
    path.write_text(kubeconfig_yaml(cluster.server, (cluster.workdir / "pki" / "ca.crt").read_bytes(),
                                    {"token": token}, user_name=f"{namespace}-{service_account}"))
    path.chmod(0o600)
    return path


def chart_operator_args(cluster: Cluster, namespace: str, deployment: str) -> list[str]:
    """The `tokenmill` arguments the installed chart gives the operator container."""
    deploy = get(cluster, "deployment", deployment, namespace)
    assert deploy is not None, f"deployment {namespace}/{deployment} not found"
    return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])


class OperatorProcess:
    """`tokenmill operator` as a local process, with the chart's arguments and a ServiceAccount's token.

    The liveness endpoint moves to a free loopback port (the chart's listens on all interfaces in a pod),
    the metrics port to a free port, and --interval is shortened so tests do not wait 15 s per pass.
    """

    def __init__(self, args: list[str], kubeconfig: Path, log: Path, interval: float = 2.0):
        self.port = free_port()
        self.metrics_port = free_port() if any(a.startswith("--metrics-port") for a in args) else None
        kept = [a for a in args if not a.startswith(("--liveness", "--interval", "--metrics-port"))]
        self.argv = [str(REPO / ".venv" / "bin" / "tokenmill"), *kept, f"--kubeconfig={kubeconfig}",
                     f"--liveness=http://127.0.0.1:{self.port}/healthz", f"--interval={interval}"]
        if self.metrics_port:
            self.argv.append(f"--metrics-port={self.metrics_port}")
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        # A fresh Hub cache each start, as a restarted operator pod has: the default (~/.cache/huggingface)
        # outlives test runs, and a config.json an earlier run cached was never asked for again (a CI on a
        # clean home saw the operator's fetch that a warm home hid).
        home = tempfile.mkdtemp(prefix="operator-hf-home-", dir=self.log.parent)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HOME": home}
        env.pop("KUBECONFIG", None)
        env.pop("HF_HUB_CACHE", None)
        with open(self.log, "ab") as f:
            f.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n".encode())
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=REPO)
        import urllib.request

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, "the operator's liveness endpoint", timeout=60)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


@contextlib.contextmanager
def replaced_operator(cluster: Cluster, operator: OperatorProcess, chart_release: str, extra_args: list[str],
                      log: Path) -> Iterator[OperatorProcess]:
    """The session's operator stopped and one with the chart's arguments plus `extra_args` in its place
    (two operators would both reconcile every object); the session's one is started again afterwards."""
    operator.stop()
    kubeconfig = Path(next(a for a in operator.argv if a.startswith("--kubeconfig=")).split("=", 1)[1])
    args = [*chart_operator_args(cluster, OPERATOR_NAMESPACE, chart_release), *extra_args]
    mine = OperatorProcess(args, kubeconfig, log).start()
    try:
        yield mine
    finally:
        mine.stop()
        operator.start()


def dump_debug(cluster: Cluster, namespace: str) -> None:
    """Print what a failed test needs to be understood (shown by pytest only on failure)."""
    for kind in (ISVC, "deployments", "pods", "events"):
        proc = cluster.kubectl("get", kind, "-n", namespace, "-o", "wide", check=False)
        print(f"--- {kind} in {namespace}:\n{proc.stdout}{proc.stderr}", file=sys.stderr)
