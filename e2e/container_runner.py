"""Container mode of the pod runner: a kwok pod's container runs as a podman container of the pod's image.

e2e/pod_runner.py resolves a container's environment, volumes and probes as a kubelet does; for a pod
labelled `e2e.tokenmill.dev/pod-runtime=podman` (or every runner pod, with TOKENMILL_E2E_POD_RUNTIME=podman)
it executes, instead of the command from the checkout's .venv, a foreground `podman run` built here:

- the pod's image (images/build.sh builds them locally; nothing is pulled), its command as the entrypoint
  and its args, its env (the kubelet-resolved values, paths as written: the container has the pod's
  mount points), its workingDir;
- the pod's securityContext: runAsUser/runAsGroup (--user), fsGroup (--group-add, and the volume folders
  are group-owned by it and group-writable, as the kubelet does), readOnlyRootFilesystem (--read-only,
  with no extra tmpfs), allowPrivilegeEscalation=false (no-new-privileges), capabilities drop/add, the
  runtime's default seccomp profile;
- the pod's volumes as bind mounts of the runner's folders at their mountPath (readOnly kept); an
  emptyDir of medium Memory at /dev/shm becomes the container's /dev/shm of that sizeLimit;
- the host's network namespace: the pod IP is a loopback address and `--host 0.0.0.0` becomes
  `--host <pod IP>` (the runner's bind-address deviation), so the engine is published at podIP:port and
  the runner's real probes and the operator reach it there; the other way round, the container reaches
  what listens on the host's loopback (the Hub stand-in at the HF_ENDPOINT the operator writes).

The podman process is the container's process for the runner: its exit code is the container's, SIGTERM
to it is forwarded to the container (--sig-proxy), and `sweep()` removes what a SIGKILL left behind.
CONTAINER_DEVIATIONS lists what differs from a kubelet in this mode (docs/e2e.md has the same list).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTAINERS_CONF = REPO / "images" / "containers.conf"
RUNTIME_LABEL = "e2e.tokenmill.dev/pod-runtime"
RUNTIME_ENV = "TOKENMILL_E2E_POD_RUNTIME"
OWNER_LABEL = "dev.tokenmill.e2e.pod-uid"  # on every container started here: what sweep() removes
# The engine's C++ CPU kernels compile at first use into the pod's /cache, minutes on 2 cores; the engine
# containers share one build folder instead, as a node's warm cache would. torch keys each build by its
# sources, flags and include paths, and kernels/cpu.py by the CPU's flags and torch's version, so an image
# with other kernels or another torch builds its own next to it.
KERNEL_CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / "images" / \
    "torch-extensions"
KERNEL_CACHE_MOUNT = "/var/cache/tokenmill-kernels"

CONTAINER_DEVIATIONS = (
    "network: the host's network namespace (the pod IP is a loopback address on it); --host 0.0.0.0 "
    "becomes --host <pod IP>, as in process mode. A URL on the host's loopback (the Hub stand-in's "
    "HF_ENDPOINT http://127.0.0.1:PORT, the operator's --hf-endpoint) is therefore reached from the container "
    "as from the host; in a pod's own network namespace 127.0.0.1 would be the pod itself",
    "KV pool: the process mode's --kv-cache-memory cap applies",
    "device: no GPU is passed in (a --tensor-parallel-size N engine runs its N ranks as CPU processes in "
    "the container, over gloo)",
    "kernels: TORCH_EXTENSIONS_DIR points at a folder shared by all engine containers (the C++ CPU "
    f"kernels' build, mounted at {KERNEL_CACHE_MOUNT}) unless the pod sets it",
    "not enforced: CPU and memory requests and limits, exec and grpc probes (run on the host)",
)


def podman_env() -> dict[str, str]:
    """podman's environment: this repository's containers.conf (runc, cgroupfs, no default ulimits)."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def wanted(pod: dict) -> bool:
    """Does this pod run in podman (its label, or the runner-wide switch)?"""
    labels = pod["metadata"].get("labels") or {}
    return labels.get(RUNTIME_LABEL, os.environ.get(RUNTIME_ENV, "")) == "podman"


def local_image(image: str) -> str:
    """The local image for a pod's image name: as written, else under localhost/ (how images/build.sh
    names them); nothing is ever pulled."""
    for ref in (image, f"localhost/{image}"):
        if podman("image", "exists", ref, check=False).returncode == 0:
            return ref
    raise LookupError(f'image "{image}" is not in local storage (make images builds the project\'s; '
                      "nothing is pulled here)")


def image_id(ref: str) -> str:
    return podman("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()


def container_name(pod: dict, container: str) -> str:
    return f"tm-{pod['metadata']['name'][:40]}-{container}-{pod['metadata']['uid'][:8]}"


def _grant_fs_group(path: Path, gid: int) -> None:
    """The kubelet's fsGroup ownership: group-owned, group-writable, setgid so new files keep the group."""
    os.chown(path, -1, gid)
    path.chmod(0o2775)


def _size_bytes(text: str | None) -> int | None:
    if not text:
        return None
    from kubernetes.utils import parse_quantity

    return int(parse_quantity(text))


def security_args(pod_sc: dict, sc: dict) -> list[str]:
    """podman flags for the pod's and the container's securityContext (the container's wins)."""
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    args: list[str] = []
    if uid is not None:
        args += ["--user", f"{uid}:{gid}" if gid is not None else str(uid)]
    if pod_sc.get("fsGroup") is not None:
        args += ["--group-add", str(pod_sc["fsGroup"])]
    for g in pod_sc.get("supplementalGroups") or []:
        args += ["--group-add", str(g)]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]  # writable: the pod's volumes only
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("privileged"):
        args += ["--privileged"]
    caps = sc.get("capabilities") or {}
    for cap in caps.get("drop") or []:
        args += ["--cap-drop", cap]
    for cap in caps.get("add") or []:
        args += ["--cap-add", cap]
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]  # RuntimeDefault: podman's default profile
    return args


def run_argv(pod: dict, spec: dict, mounts: dict[str, Path], env: dict[str, str], argv: list[str],
             command_len: int, image: str) -> list[str]:
    """The `podman run` command line for one container of `pod` (mounts: mountPath -> the runner's folder
    for it, as pod_runner.PodWorker.container_spec resolved them)."""
    pod_spec = pod["spec"]
    pod_sc = pod_spec.get("securityContext") or {}
    name = container_name(pod, spec["name"])
    out = ["podman", "run", "--rm", "--replace", "--name", name, "--pull=never", "--network=host",
           "--sig-proxy=true", "--label", f"{OWNER_LABEL}={pod['metadata']['uid']}", "--log-driver=none",
           "--stop-timeout", str(int(pod_spec.get("terminationGracePeriodSeconds", 30)))]
    out += security_args(pod_sc, spec.get("securityContext") or {})
    by_name = {v["name"]: v for v in pod_spec.get("volumes") or []}
    for m in spec.get("volumeMounts") or []:
        vol = by_name.get(m["name"], {})
        if m["mountPath"] == "/dev/shm" and (vol.get("emptyDir") or {}).get("medium") == "Memory":
            size = _size_bytes(vol["emptyDir"].get("sizeLimit"))
            out += [f"--shm-size={size}"] if size else []
            continue
        host = mounts.get(m["mountPath"])
        if host is None:
            continue
        if pod_sc.get("fsGroup") is not None and not any(k in vol for k in ("secret", "configMap")):
            _grant_fs_group(host, int(pod_sc["fsGroup"]))
        out += ["--volume", f"{host}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}"]
    env = dict(env)
    if "TORCH_EXTENSIONS_DIR" not in env:
        KERNEL_CACHE.mkdir(parents=True, exist_ok=True)
        KERNEL_CACHE.chmod(0o1777)  # any pod UID may build into it, as into its own /cache
        out += ["--volume", f"{KERNEL_CACHE}:{KERNEL_CACHE_MOUNT}"]
        env["TORCH_EXTENSIONS_DIR"] = KERNEL_CACHE_MOUNT
    for k, v in env.items():
        out += ["--env", f"{k}={v}"]
    if spec.get("workingDir"):
        out += ["--workdir", spec["workingDir"]]
    command, args = argv[:command_len], argv[command_len:]
    if command:
        out += ["--entrypoint", json.dumps(command)]
    return [*out, image, *args]


def resolved(pod: dict, spec: dict, pc, dns: dict[str, str], pod_dir: Path) -> tuple[list[str], dict[str, str], Path]:
    """pod_runner's hook: (argv, env, cwd) of the `podman run` process for container `spec` of `pod`, from
    what the kubelet would hand a runtime (pc: pod_runner.PodContainer; dns: env values that are pod DNS
    names -> those pods' IPs, as there is no cluster DNS here)."""
    from pod_runner import ConfigError, apply_deviations

    try:
        image = local_image(pc.image)
    except LookupError as e:  # the kubelet's ErrImageNeverPull, retried like a config error
        raise ConfigError(str(e)) from None
    env = {k: dns.get(v, v) for k, v in pc.env.items()}
    env.setdefault("HOSTNAME", pc.hostname)
    argv = apply_deviations(pc.argv, pc.pod_ip)
    command_len = len(spec.get("command") or [])
    return run_argv(pod, spec, pc.mounts, env, argv, command_len, image), podman_env(), pod_dir


def build_images() -> dict[str, str]:
    """The chart-tagged local images {"engine": ..., "operator": ...}; images/build.sh builds what is
    missing (nothing when `make images` ran, the usual case: a cold build takes many minutes)."""
    why = available()
    if why is not None:
        raise AssertionError(why)
    # TOKENMILL_IMAGES_PREBUILT=1: use the images as tagged, do not check their inputs (while a build runs).
    check = ["--names"] if os.environ.get("TOKENMILL_IMAGES_PREBUILT") == "1" else []
    proc = subprocess.run(["bash", str(REPO / "images" / "build.sh"), *check], capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise AssertionError(f"images/build.sh failed:\n{proc.stderr[-3000:]}")
    engine, operator = proc.stdout.split()
    return {"engine": engine, "operator": operator}


def written_outside_volumes(container: str) -> list[str]:
    """`podman diff` of a container's root file system, less what podman itself makes there: the mount
    points of its volumes (and the folders above them) and its /etc/hosts, /etc/hostname, resolv.conf."""
    info = json.loads(podman("inspect", container).stdout)[0]
    made = {"/etc", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run", "/run/.containerenv"}
    for m in info.get("Mounts") or []:
        for dest in (m["Destination"], m["Destination"].replace("/var/run/", "/run/", 1)):  # /var/run -> /run
            path = Path(dest)
            made |= {str(path), *(str(p) for p in path.parents)}
    changes = podman("diff", container).stdout.split("\n")
    return [c for c in changes if c.strip() and c.split(maxsplit=1)[1] not in made]


def sweep(pod_uid: str | None = None) -> None:
    """Remove the containers this module started (for one pod, or all): what a SIGKILL left behind."""
    label = f"{OWNER_LABEL}={pod_uid}" if pod_uid else OWNER_LABEL
    ids = podman("ps", "-aq", "--filter", f"label={label}", check=False).stdout.split()
    if ids:
        podman("rm", "-f", "-t", "0", *ids, check=False)


def available() -> str | None:
    """None when podman can run containers here, else why not."""
    if shutil.which("podman") is None:
        return "podman is not installed (make image-tools installs Debian's podman and runc)"
    proc = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    return None if proc.returncode == 0 else f"podman info failed: {proc.stderr[-500:]}"


if __name__ == "__main__":  # `python e2e/container_runner.py sweep`: remove leftovers of a killed session
    if sys.argv[1:] == ["sweep"]:
        sweep()
