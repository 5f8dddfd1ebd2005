"""A real local Kubernetes control plane for the e2e tests and `make cluster-up`.

etcd -> kube-apiserver -> kube-controller-manager -> kube-scheduler -> kwok, all on 127.0.0.1 with
free ports, then kwok Nodes that advertise `nvidia.com/gpu`; `up` then starts the LeaderWorkerSet
controller and Kueue beside it (e2e/kueue_controller.py; the pytest fixtures start those on demand). Binaries come from
e2e/build_cluster_tools.sh (built from the Go module proxy, cached by version outside the repo).
Every process is recorded by PID in `<workdir>/cluster.json` as soon as it starts, so `down` (and a
failed `up`) stops exactly what was started and nothing else.

    python e2e/cluster.py up [--workdir .e2e]     # prints the kubeconfig path
    python e2e/cluster.py down [--workdir .e2e]
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "e2e" / "build_cluster_tools.sh"
KWOK_STAGES = REPO / "e2e" / "kwok_stages.yaml"
SERVICE_CIDR = "10.96.0.0/24"  # nothing ever connects to ClusterIPs here (no kube-proxy)
# kwok hands out pod IPs from a loopback range: the operator scrapes pod IPs for metrics, and traffic
# must never leave this machine. A connection to 127.x.y.z is refused (or reaches a test's server).
# Each cluster draws its own /20 in 127.200.0.0-127.254.255.255: several clusters run at once on one
# machine (worktrees, CI), and the pod runner's engines bind their pod IP, so two clusters handing out the
# same IP would collide on its port (seen: "address already in use" on 127.244.0.1:8000).
POD_CIDR_PREFIX = 20


def pod_cidr() -> str:
    return f"127.{random.randint(200, 254)}.{16 * random.randint(0, 15)}.0/{POD_CIDR_PREFIX}"


NODE_IP = "127.0.0.1"
# The order processes start in; they stop in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class ClusterError(RuntimeError):
    """The cluster could not be built, started or stopped; the message says what and where to look."""


@dataclass(frozen=True, slots=True)
class GPUNode:
    """A kwok Node; `gpu_product` is the value GPU feature discovery puts in `nvidia.com/gpu.product`."""

    name: str
    gpu_product: str
    gpus: int
    cpu: str = "96"
    memory: str = "1024Gi"


# Two node pools, so GPU-type node selection and per-node GPU capacity are both exercised.
DEFAULT_NODES = (
    GPUNode("gpu-h100-0", "NVIDIA-H100-80GB-HBM3", 8),
    GPUNode("gpu-h100-1", "NVIDIA-H100-80GB-HBM3", 8),
    GPUNode("gpu-l4-0", "NVIDIA-L4", 4),
)


@dataclass(slots=True)
class Tools:
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    kwok: Path
    helm: Path


@dataclass(slots=True)
class Cluster:
    workdir: Path
    kubeconfig: Path
    server: str
    tools: Tools
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return run_tool([str(self.tools.kubectl), f"--kubeconfig={self.kubeconfig}", *args], input, check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_tool([str(self.tools.helm), f"--kubeconfig={self.kubeconfig}", *args], None, check,
                        env=helm_env(self.workdir))


def run_tool(argv: list[str], input: str | None = None, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, env=env, timeout=300)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv[:4])}... exited {proc.returncode}:\n{proc.stderr or proc.stdout}")
    return proc


def helm_env(workdir: Path) -> dict[str, str]:
    """Keep helm's caches and config inside the workdir, not in the user's home."""
    return {**os.environ, "HELM_CACHE_HOME": str(workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(workdir / "helm" / "data")}


# ---------------------------------------------------------------- tools


def ensure_tools(env: dict[str, str] | None = None) -> Tools:
    """Build (once, cached by version) and locate every binary; raise ClusterError if the build fails."""
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})
    tail: list[str] = []
    assert proc.stderr is not None and proc.stdout is not None
    for line in proc.stderr:  # stream the (long, cold) build log, keep its end for the error message
        sys.stderr.write(line)
        tail = [*tail[-19:], line.rstrip()]
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise ClusterError(f"building the cluster tools failed (exit {proc.returncode}); the build log "
                           f"ends with:\n" + "\n".join(tail) +
                           f"\nRe-run `bash {BUILD_SCRIPT.relative_to(REPO)}` to retry.")
    dirs = [Path(d) for d in out.strip().splitlines()[-1].split(":")]
    if time.monotonic() - t0 > 30:
        print(f"[cluster] tools built in {time.monotonic() - t0:.0f}s", file=sys.stderr)

    def find(name: str) -> Path:
        for d in dirs:
            if (d / name).exists():
                return d / name
        raise ClusterError(f"{name} not found in {dirs} after the build")

    return Tools(find("kube-apiserver"), find("kube-controller-manager"), find("kube-scheduler"),
                 find("kubectl"), find("etcd"), find("kwok"), find("helm"))


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int, who: str) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ClusterError(f"port {port} on 127.0.0.1 is already in use, so {who} cannot listen there "
                               f"({e.strerror}); stop whatever holds it or choose another port") from None


def _state_path(workdir: Path) -> Path:
    return workdir / "cluster.json"


def _save_state(workdir: Path, state: dict) -> None:
    tmp = _state_path(workdir).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(_state_path(workdir))


def _is_ours(pid: int, exe: str) -> bool:
    """The PID still runs the binary we started (PIDs get reused after a process exits)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return argv0 == exe


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


def stop_processes(workdir: Path, grace: float = 10.0) -> list[str]:
    """SIGTERM every recorded process (reverse start order), SIGKILL after `grace`; returns what it stopped."""
    path = _state_path(workdir)
    if not path.exists():
        return []
    state = json.loads(path.read_text())
    procs = state.get("processes", {})
    live = {n: p for n, p in procs.items() if _is_ours(p["pid"], p["exe"])}
    # Controllers started beside the cluster (LWS, Kueue) first, newest first, while the API server they
    # talk to is still up.
    order = [n for n in reversed(live) if n not in COMPONENTS] + [n for n in reversed(COMPONENTS) if n in live]
    for name in order:
        with contextlib.suppress(ProcessLookupError):
            os.kill(live[name]["pid"], signal.SIGTERM)
        _wait_gone(live[name]["pid"], grace)
    for name in order:
        if not _zombie_or_gone(live[name]["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(live[name]["pid"], signal.SIGKILL)
            _wait_gone(live[name]["pid"], 5)
    # Keep the record of what ran (tests check those PIDs are gone); only "processes" counts as live.
    state["stopped"] = [*state.get("stopped", []), *procs.values()]
    state["processes"] = {}
    _save_state(workdir, state)
    return order


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:  # reap our own child if it is one
                return
        if _zombie_or_gone(pid):
            return
        time.sleep(0.05)


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _start(workdir: Path, state: dict, name: str, argv: list[str]) -> subprocess.Popen:
    log = workdir / "logs" / f"{name}.log"
    with open(log, "ab") as f:  # appended: a restarted component keeps its old log
        # A new session: the process outlives `cluster.py up` and a Ctrl-C in the shell does not reach it.
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=workdir)
    state["processes"][name] = {"pid": proc.pid, "exe": argv[0], "log": str(log), "argv": argv}
    _save_state(workdir, state)
    return proc


def _wait_until(check, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"{what} exited with code {proc.returncode} while starting; last log lines "
                               f"({log}):\n{_log_tail(log)}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ssl.SSLError) as e:
            last = str(e)
        time.sleep(0.2)
    raise ClusterError(f"{what} was not ready after {timeout:.0f}s ({last}); last log lines ({log}):\n"
                       f"{_log_tail(log)}")


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False


def node_manifest(node: GPUNode) -> dict:
    resources = {"cpu": node.cpu, "memory": node.memory, "pods": "110", "nvidia.com/gpu": str(node.gpus)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": node.name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", "type": "kwok",
                       "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": node.gpu_product,
                       "nvidia.com/gpu.count": str(node.gpus)},
        },
        # kwok keeps capacity/allocatable as given and fills in conditions, addresses and nodeInfo.
        "status": {"capacity": resources, "allocatable": resources},
    }


# ---------------------------------------------------------------- up / down


def start_cluster(workdir: Path, nodes: tuple[GPUNode, ...] = DEFAULT_NODES, tools: Tools | None = None,
                  ports: dict[str, int] | None = None, timeout: float = 120.0, kubelet: bool = False) -> Cluster:
    """Start everything; on any failure stop what was started and raise ClusterError. `kubelet`: kwok only
    hands out pod IPs and the pod runner (started by `up`) runs every pod it can (kwok_stages_for)."""
    workdir = workdir.resolve()
    if _state_path(workdir).exists() and any(
            _is_ours(p["pid"], p["exe"]) for p in json.loads(_state_path(workdir).read_text())["processes"].values()):
        raise ClusterError(f"a cluster recorded in {workdir} is still running; stop it first "
                           f"(`python e2e/cluster.py down --workdir {workdir}` or `make cluster-down`)")
    tools = tools or ensure_tools()
    wanted = {"etcd": 0, "etcd-peer": 0, "kube-apiserver": 0, "kube-controller-manager": 0,
              "kube-scheduler": 0, "kwok": 0, **(ports or {})}
    for who, port in wanted.items():
        if port:
            check_port_free(port, who)
    ports = {who: port or free_port() for who, port in wanted.items()}

    for sub in ("pki", "etcd-data", "logs", "helm"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    (workdir / "logs").mkdir(parents=True)
    from pki import admin_kubeconfig, write_pki  # needs `cryptography`; `down` must work without it

    pki = workdir / "pki"
    # The `kubernetes` Service's ClusterIP (first address of SERVICE_CIDR) must be in the serving cert.
    write_pki(pki, str(next(ipaddress.ip_network(SERVICE_CIDR).hosts())))
    server = f"https://127.0.0.1:{ports['kube-apiserver']}"
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(admin_kubeconfig(server, pki))
    kubeconfig.chmod(0o600)
    state = {"server": server, "kubeconfig": str(kubeconfig), "ports": ports, "processes": {}}
    _save_state(workdir, state)
    cluster = Cluster(workdir, kubeconfig, server, tools, ports)
    t0 = time.monotonic()
    try:
        _bring_up(cluster, state, pki, nodes, timeout, kubelet)
    except BaseException:
        stop_processes(workdir)
        raise
    print(f"[cluster] up in {time.monotonic() - t0:.1f}s: {server} (kubeconfig {kubeconfig})", file=sys.stderr)
    return cluster


def kwok_stages_for(workdir: Path, kubelet: bool) -> Path:
    """kwok's stages: e2e/kwok_stages.yaml; in kubelet mode without pod-ready and with pod-runner-start
    for every pod (an IP, Pending and not ready until the pod runner writes what its processes do)."""
    if not kubelet:
        return KWOK_STAGES
    import yaml

    stages = [s for s in yaml.safe_load_all(KWOK_STAGES.read_text()) if s["metadata"]["name"] != "pod-ready"]
    for stage in stages:
        stage["spec"]["selector"].pop("matchLabels", None)
    path = workdir / "kwok-stages-kubelet.yaml"
    path.write_text(yaml.safe_dump_all(stages, sort_keys=False))
    return path


def _bring_up(c: Cluster, state: dict, pki: Path, nodes: tuple[GPUNode, ...], timeout: float,
              kubelet: bool = False) -> None:
    w, p, t = c.workdir, c.ports, c.tools
    logs = w / "logs"
    etcd_url = f"http://127.0.0.1:{p['etcd']}"
    proc = _start(w, state, "etcd", [
        str(t.etcd), f"--data-dir={w / 'etcd-data'}", f"--listen-client-urls={etcd_url}",
        f"--advertise-client-urls={etcd_url}", f"--listen-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
        f"--initial-cluster=default=http://127.0.0.1:{p['etcd-peer']}",
        "--unsafe-no-fsync=true", "--quota-backend-bytes=2147483648", "--log-level=warn"])
    _wait_until(lambda: _http_ok(f"{etcd_url}/health"), "etcd", proc, logs / "etcd.log", timeout)

    proc = _start(w, state, "kube-apiserver", [
        str(t.kube_apiserver), f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1", f"--secure-port={p['kube-apiserver']}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}", f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--service-account-issuer={c.server}", f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}", "--authorization-mode=Node,RBAC",
        "--allow-privileged=true", "--profiling=false", f"--cert-dir={pki}"])
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    _wait_until(lambda: _http_ok(f"{c.server}/readyz", ctx), "kube-apiserver", proc,
                logs / "kube-apiserver.log", timeout)

    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE  # self-signed serving certs
    kc = str(c.kubeconfig)
    proc = _start(w, state, "kube-controller-manager", [
        str(t.kube_controller_manager), f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}", "--leader-elect=false", "--bind-address=127.0.0.1",
        f"--secure-port={p['kube-controller-manager']}", f"--cert-dir={w / 'pki' / 'kcm'}",
        f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
        "--use-service-account-credentials=false", f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--profiling=false"])
    _wait_until(lambda: _http_ok(f"https://127.0.0.1:{p['kube-controller-manager']}/healthz", insecure),
                "kube-controller-manager", proc, logs / "kube-controller-manager.log", timeout)

    proc = _start(w, state, "kube-scheduler", [
        str(t.kube_scheduler), f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}", "--leader-elect=false", "--bind-address=127.0.0.1",
        f"--secure-port={p['kube-scheduler']}", f"--cert-dir={w / 'pki' / 'scheduler'}", "--profiling=false"])
    _wait_until(lambda: _http_ok(f"https://127.0.0.1:{p['kube-scheduler']}/healthz", insecure),
                "kube-scheduler", proc, logs / "kube-scheduler.log", timeout)

    proc = _start(w, state, "kwok", [
        str(t.kwok), f"--kubeconfig={kc}", "--manage-all-nodes=true", f"--cidr={pod_cidr()}",
        # Node health through Leases renewed every 10 s (as kwokctl runs it): without them kwok only
        # refreshes node status about once a minute and the node lifecycle controller flips every node
        # NotReady for a few seconds each time, which marks every pod unready.
        f"--node-ip={NODE_IP}", "--node-lease-duration-seconds=40", f"--server-address=127.0.0.1:{p['kwok']}",
        # Pods labelled for e2e/pod_runner.py are not made Ready by kwok (their real processes decide).
        f"--config={kwok_stages_for(w, kubelet)}"])
    _wait_until(lambda: _http_ok(f"http://127.0.0.1:{p['kwok']}/healthz"), "kwok", proc,
                logs / "kwok.log", timeout)

    # The controller-manager creates each namespace's `default` ServiceAccount; pods need it.
    _wait_until(lambda: c.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
                "the default ServiceAccount (kube-controller-manager)", proc, logs / "kube-controller-manager.log",
                timeout)
    manifest = {"apiVersion": "v1", "kind": "List", "items": [node_manifest(n) for n in nodes]}
    c.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    c.kubectl("wait", "--for=condition=Ready", "node", "--all", f"--timeout={int(timeout)}s")
    c.pids.update({n: v["pid"] for n, v in state["processes"].items()})


def restart_component(cluster: Cluster, name: str, timeout: float = 120.0) -> float:
    """Stop one recorded component by PID (SIGTERM) and start it again with the same argv (chaos tests);
    returns how long it was down. Only the API server's readiness is awaited (the others have none that
    matters to the tests)."""
    state = json.loads(_state_path(cluster.workdir).read_text())
    rec = state["processes"][name]
    t0 = time.monotonic()
    if _is_ours(rec["pid"], rec["exe"]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["pid"], signal.SIGTERM)
        _wait_gone(rec["pid"], 30)
    proc = _start(cluster.workdir, state, name, rec["argv"])
    cluster.pids[name] = proc.pid
    if name == "kube-apiserver":
        pki = cluster.workdir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        _wait_until(lambda: _http_ok(f"{cluster.server}/readyz", ctx), name, proc,
                    cluster.workdir / "logs" / f"{name}.log", timeout)
    return time.monotonic() - t0


def load_cluster(workdir: Path) -> Cluster:
    """The running cluster recorded in `workdir` (for tests pointed at a `make cluster-up` cluster)."""
    workdir = workdir.resolve()
    if not _state_path(workdir).exists():
        raise ClusterError(f"no cluster recorded in {workdir}; run `make cluster-up` first")
    state = json.loads(_state_path(workdir).read_text())
    dead = [n for n, p in state["processes"].items() if not _is_ours(p["pid"], p["exe"])]
    if dead or not state["processes"]:
        raise ClusterError(f"the cluster in {workdir} is not running (stopped: {dead or 'all'}); "
                           f"run `make cluster-down cluster-up`")
    return Cluster(workdir, Path(state["kubeconfig"]), state["server"], ensure_tools(), state["ports"],
                   {n: p["pid"] for n, p in state["processes"].items()})


def start_platform(cluster: Cluster) -> None:
    """What `make cluster-up` adds for `tokenmill operator` and routed services: the InferenceService CRD,
    the InferencePool CRDs (e2e/build_epp.sh), the endpoint picker's ClusterRole under the operator's
    default --epp-cluster-role, and the pod runner in kubelet mode (a process recorded like the others)."""
    from traffic import EPP_RULES, ensure_epp, install_crds  # imports this module: not at the top

    for crd in sorted((REPO / "crds").glob("*.yaml")):
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
    install_crds(cluster, ensure_epp())
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "tokenmill-epp"},
            "rules": EPP_RULES}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    state = json.loads(_state_path(cluster.workdir).read_text())
    argv = [sys.executable, str(REPO / "e2e" / "pod_runner.py"), f"--kubeconfig={cluster.kubeconfig}",
            f"--workdir={cluster.workdir}", "--every-pod"]
    proc = _start(cluster.workdir, state, "pod-runner", argv)
    log = cluster.workdir / "logs" / "pod-runner.log"
    _wait_until(lambda: "pod folders in" in log.read_text(errors="replace"), "the pod runner", proc, log, 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/cluster.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "build"])
    parser.add_argument("--workdir", type=Path, default=REPO / ".e2e")
    parser.add_argument("--apiserver-port", type=int, default=0, help="default: a free port")
    args = parser.parse_args(argv)
    try:
        if args.action == "build":
            tools = ensure_tools()
            print(json.dumps({k: str(v) for k, v in asdict(tools).items()}, indent=2))
        elif args.action == "up":
            args.workdir.mkdir(parents=True, exist_ok=True)
            cluster = start_cluster(args.workdir, ports={"kube-apiserver": args.apiserver_port}, kubelet=True)
            try:
                import kueue_controller  # imports this module: not at the top

                kueue_controller.start(cluster)  # the LWS controller too, first
                start_platform(cluster)
            except BaseException:
                stop_processes(cluster.workdir)
                raise
            print(f"export KUBECONFIG={cluster.kubeconfig}")
            print(f"# kubectl: {cluster.tools.kubectl}  helm: {cluster.tools.helm}")
        else:
            stopped = stop_processes(args.workdir)
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
