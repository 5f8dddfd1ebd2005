"""The engine and operator images (make images / images/build.sh), run for real with podman.

The engine image serves the bundled model to the official openai client while running as the operator's
pods run it: UID 1000, read-only root file system, every capability dropped, no privilege escalation,
the pod's /cache, /tmp and /dev/shm as the only writable places. The operator image reconciles an
InferenceService to Ready in the e2e cluster with the chart's ServiceAccount token.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import container_runner
import pytest
from cluster import REPO, Cluster, free_port
from container_runner import podman
from e2e_helpers import (
    ISVC,
    OPERATOR_NAMESPACE,
    RELEASE,
    OperatorProcess,
    apply,
    chart_operator_args,
    get,
    ready_for_current_generation,
    sa_kubeconfig,
    wait_for,
)

ENGINE_UID = 1000  # tokenmill.operator.children.pod.ENGINE_UID, read from the Deployment below as well
RESTRICTED = ["--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL",
              "--security-opt", "no-new-privileges"]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return container_runner.build_images()


def _container(name: str) -> Iterator[str]:
    podman("rm", "-f", "-t", "0", name, check=False)
    try:
        yield name
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)


@pytest.fixture
def engine_container() -> Iterator[str]:
    yield from _container(f"tm-test-engine-{free_port()}")


@pytest.fixture
def operator_container() -> Iterator[str]:
    yield from _container(f"tm-test-operator-{free_port()}")


def _wait_http(url: str, container: str, timeout: float) -> None:
    def up() -> bool:
        state = podman("inspect", "--format", "{{.State.Status}}", container, check=False).stdout.strip()
        if state in ("exited", "stopped", ""):
            logs = podman("logs", container, check=False)
            raise AssertionError(f"container {container} is {state or 'gone'}:\n{(logs.stdout + logs.stderr)[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(up, url, timeout=timeout, interval=1)


def test_engine_image_contents(images: dict[str, str]) -> None:
    """tokenmill --version inside; the numeric non-root user; what the pod spec relies on."""
    ref = images["engine"]
    cfg = json.loads(podman("image", "inspect", ref).stdout)[0]["Config"]
    assert cfg["User"] == f"{ENGINE_UID}:{ENGINE_UID}"
    assert cfg["Entrypoint"] == ["tokenmill"]
    out = podman("run", "--rm", "--network=none", *RESTRICTED, "--entrypoint", "tokenmill", ref, "--version")
    from importlib.metadata import version

    assert out.stdout.strip() == f"tokenmill {version('tokenmill')}"
    # The compiler for the C++ CPU kernels is there (the engine image builds them for the node's CPU).
    assert podman("run", "--rm", "--network=none", "--entrypoint", "g++", ref, "--version").returncode == 0


def test_operator_image_has_no_compiler_and_runs_as_the_chart_user(images: dict[str, str]) -> None:
    import yaml

    ref = images["operator"]
    chart_uid = yaml.safe_load((REPO / "charts" / "tokenmill-operator" / "values.yaml").read_text())[
        "podSecurityContext"]["runAsUser"]
    cfg = json.loads(podman("image", "inspect", ref).stdout)[0]["Config"]
    assert cfg["User"] == f"{chart_uid}:{chart_uid}"
    out = podman("run", "--rm", "--network=none", *RESTRICTED, "--entrypoint", "tokenmill", ref, "--version")
    assert out.stdout.startswith("tokenmill ")
    for cc in ("cc", "gcc", "g++", "c++", "clang"):
        probe = podman("run", "--rm", "--network=none", "--entrypoint", "sh", ref, "-c", f"command -v {cc}",
                       check=False)
        assert probe.returncode != 0, f"{cc} found in the operator image: {probe.stdout}"
    # No torch: the operator image is the small one.
    probe = podman("run", "--rm", "--network=none", "--entrypoint", "python3", ref, "-c", "import torch",
                   check=False)
    assert probe.returncode != 0


def test_engine_image_serves_the_bundled_model_under_the_restricted_profile(
        images: dict[str, str], engine_container: str, tmp_path: Path) -> None:
    """podman run as the operator's pod runs it; the official openai client gets a completion; the root
    file system is unchanged afterwards; the C++ kernels were built by the image's compiler."""
    import openai

    ref = images["engine"]
    port = free_port()
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    # The kernels' build is shared by every run of this image (container_runner's folder), not per test.
    kernels = container_runner.KERNEL_CACHE
    for d in (cache, tmp, kernels):
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o1777)
    podman("run", "-d", "--name", engine_container, "--network=host", "--user", f"{ENGINE_UID}:{ENGINE_UID}",
           *RESTRICTED, "--shm-size=256m",
           "--volume", f"{cache}:/cache", "--volume", f"{tmp}:/tmp",
           "--volume", f"{kernels}:{container_runner.KERNEL_CACHE_MOUNT}",
           "--env", "HOME=/cache", "--env", "XDG_CACHE_HOME=/cache", "--env", "OMP_NUM_THREADS=1",
           "--env", f"TORCH_EXTENSIONS_DIR={container_runner.KERNEL_CACHE_MOUNT}",
           ref, "serve", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
           "--max-model-len", "512", "--max-num-seqs", "4")
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", engine_container, timeout=900)  # a cold kernel build takes minutes here

    # The first forward builds the C++ kernels when this image has not built them yet: minutes here.
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=1200, max_retries=0)
    rsp = client.chat.completions.create(model="smollm2", max_tokens=12, temperature=0,
                                         messages=[{"role": "user", "content": "Name a colour."}])
    assert rsp.model == "smollm2"
    assert rsp.choices[0].message.content.strip()
    assert rsp.usage.completion_tokens >= 1 and rsp.usage.prompt_tokens > 5
    with pytest.raises(openai.BadRequestError):  # a client mistake is a 4xx from inside the image too
        client.completions.create(model="smollm2", prompt="x", max_tokens=-1)

    state = json.loads(podman("inspect", engine_container).stdout)[0]
    assert state["Config"]["User"] == f"{ENGINE_UID}:{ENGINE_UID}"
    assert state["HostConfig"]["ReadonlyRootfs"] is True
    assert state["HostConfig"]["CapDrop"] and not state["HostConfig"]["CapAdd"]
    status = podman("exec", engine_container, "sh", "-c", "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/1/status")
    uid, cap_eff, nnp = status.stdout.split("\n")[:3]
    assert uid == str(ENGINE_UID)
    assert cap_eff.split()[1] == "0000000000000000" and nnp.split()[1] == "1"
    assert podman("exec", engine_container, "touch", "/opt/tokenmill/x", check=False).returncode != 0
    # Nothing was written outside the mounted volumes (the read-only root file system saw no change).
    assert container_runner.written_outside_volumes(engine_container) == []
    # The image's compiler built the kernels (for this CPU) and the engine loaded them.
    assert list(kernels.rglob("*.so")), "no C++ kernel build in the shared folder"
    logs = podman("logs", engine_container)
    assert "C++ CPU kernels unavailable" not in logs.stdout + logs.stderr
    assert list(cache.rglob("config.json")), "the bundled GGUF's conversion was not cached in /cache"


def test_operator_image_reconciles_an_inference_service_to_ready(
        cluster: Cluster, operator: OperatorProcess, images: dict[str, str], namespace: str,
        operator_container: str, tmp_path: Path) -> None:
    """The operator image with the chart's arguments and its ServiceAccount's token (the local operator
    process is paused meanwhile), restricted like the chart's pod: the InferenceService goes Ready."""
    kubeconfig = sa_kubeconfig(cluster, OPERATOR_NAMESPACE, RELEASE, tmp_path / "kubeconfig")
    kubeconfig.chmod(0o644)  # read by the image's non-root user through a read-only mount
    args = chart_operator_args(cluster, OPERATOR_NAMESPACE, RELEASE)
    deploy = get(cluster, "deployment", RELEASE, OPERATOR_NAMESPACE)
    pod_spec = deploy["spec"]["template"]["spec"]
    health = free_port()
    kept = [a for a in args if not a.startswith(("--liveness", "--interval", "--metrics-port"))]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    argv = ["run", "-d", "--name", operator_container, "--network=host",
            *container_runner.security_args(pod_spec["securityContext"], pod_spec["containers"][0]["securityContext"]),
            "--volume", f"{tmp}:/tmp", "--volume", f"{kubeconfig}:/var/run/tokenmill/kubeconfig:ro",
            "--env", f"POD_ID={operator_container}",
            images["operator"], *kept, "--kubeconfig=/var/run/tokenmill/kubeconfig",
            f"--liveness=http://127.0.0.1:{health}/healthz", "--interval=2"]
    assert "--read-only" in argv and "ALL" in argv
    SERVICE = {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "chat"},
               "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
                        "resources": {"gpu": {"type": "nvidia-l4", "count": 1}}, "replicas": 1}}
    operator.stop()
    try:
        podman(*argv)
        _wait_http(f"http://127.0.0.1:{health}/healthz", operator_container, timeout=120)
        apply(cluster, SERVICE, namespace)
        obj = wait_for(lambda: (o := get(cluster, ISVC, "chat", namespace)) and ready_for_current_generation(o) and o,
                       "Ready=True from the operator image", timeout=120)
        assert obj["status"]["conditions"]
        deploy = json.loads(cluster.kubectl("get", "deployment", "chat", "-n", namespace, "-o", "json",
                                            "--show-managed-fields").stdout)
        assert "tokenmill-operator" in {m["manager"] for m in deploy["metadata"]["managedFields"]}
        logs = podman("logs", operator_container)
        assert "Forbidden" not in logs.stdout + logs.stderr
        assert container_runner.written_outside_volumes(operator_container) == []
    finally:
        podman("stop", "-t", "10", operator_container, check=False)
        time.sleep(0.5)
        operator.start()
