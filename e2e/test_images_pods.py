"""The pod runner's container mode: the bundled example's engine pod runs as a podman container of the
engine image the operator put in the pod (the chart's engineImage), with the pod's command, args, env,
UID, securityContext and volumes, published at its pod IP; readiness comes from the real probes."""

from __future__ import annotations

import copy
import json
import os

import container_runner
import httpx
import pytest
from cluster import Cluster
from container_runner import RUNTIME_LABEL, podman
from e2e_helpers import (
    ISVC,
    OperatorProcess,
    apply,
    condition,
    get,
    items,
    ready_for_current_generation,
    wait_for,
)
from pod_runner import RUNNER_LABEL, PodRunner
from test_examples import example

ENGINE_START_S = 900  # model load, and a cold build of the C++ kernels for a new image (minutes here)


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return container_runner.build_images()


def test_run_argv_carries_the_pod_spec(tmp_path) -> None:
    """Unit test (no podman, no cluster): the restricted engine pod's spec becomes these podman flags."""
    from pod_runner import PodWorker
    from test_pod_runner import _FakeApi

    c = {"name": "engine", "image": "tokenmill/engine:0.1.0", "command": ["tokenmill", "serve"],
         "args": ["--host", "0.0.0.0", "--port", "8000"], "env": [{"name": "HOME", "value": "/cache"}],
         "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                             "readOnlyRootFilesystem": True, "runAsNonRoot": True},
         "volumeMounts": [{"name": "cache", "mountPath": "/cache"}, {"name": "dshm", "mountPath": "/dev/shm"},
                          {"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True}]}
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {RUNTIME_LABEL: "podman"}},
           "spec": {"containers": [c], "nodeName": "n1", "terminationGracePeriodSeconds": 7,
                    "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": os.getgid(),
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "cfg", "emptyDir": {}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]},
           "status": {"podIP": "127.244.0.9"}}
    assert container_runner.wanted(pod)
    w = PodWorker(_FakeApi({}), pod, tmp_path / "pod", tmp_path / "claims")  # type: ignore[arg-type]
    w._prepare_volumes()
    pc = w.container_spec(c)
    argv = container_runner.run_argv(pod, c, pc.mounts, pc.env, pc.argv, 2, "localhost/tokenmill/engine:0.1.0")
    flags = " ".join(argv)
    for want in ("--user 1000:1000", f"--group-add {os.getgid()}", "--read-only --read-only-tmpfs=false",
                 "--security-opt no-new-privileges", "--cap-drop ALL", "--network=host", "--pull=never",
                 f"--shm-size={2**30}", "--env HOME=/cache", "--stop-timeout 7",
                 f"--volume {tmp_path}/pod/volumes/cache:/cache ", f"--volume {tmp_path}/pod/volumes/cfg:/etc/cfg:ro"):
        assert want in flags + " ", want
    assert "seccomp=unconfined" not in flags and "/dev/shm" not in flags
    image_at = argv.index("localhost/tokenmill/engine:0.1.0")
    assert argv[argv.index("--entrypoint") + 1] == '["tokenmill", "serve"]'
    assert argv[image_at + 1:] == ["--host", "0.0.0.0", "--port", "8000"]  # resolved() applies the deviations
    cache = tmp_path / "pod" / "volumes" / "cache"
    assert cache.stat().st_gid == os.getgid() and cache.stat().st_mode & 0o2070 == 0o2070  # the fsGroup rule


def in_podman(isvc: dict) -> dict:
    isvc = copy.deepcopy(isvc)
    labels = isvc["spec"].setdefault("template", {}).setdefault("labels", {})
    labels[RUNNER_LABEL] = "true"
    labels[RUNTIME_LABEL] = "podman"
    return isvc


def wait_ready(cluster: Cluster, namespace: str, name: str) -> dict:
    """Ready for the current generation with every desired replica ready (the runner's real probes)."""
    def ready() -> dict | None:
        o = get(cluster, ISVC, name, namespace)
        ok = o and ready_for_current_generation(o) and \
            o["status"].get("readyReplicas") == o["status"].get("desiredReplicas")
        return o if ok else None

    return wait_for(ready, f"{namespace}/{name} Ready=True with the engine image", timeout=ENGINE_START_S,
                    interval=2)


def runner_pods(cluster: Cluster, namespace: str, name: str) -> list[dict]:
    return [p for p in items(cluster, "pods", namespace, f"serving.tokenmill.dev/inferenceservice={name}")
            if not p["metadata"].get("deletionTimestamp")]


def assert_container_is_the_pod(pod: dict, pod_runner: PodRunner, engine_image: str) -> str:
    """The podman container behind `pod` runs the pod's own image, user, read-only root, command, args
    (but for the bind address and the KV cap), env values and mounts, and its readiness came from the
    runner's real probes (failed while loading, then passed). Returns the container's name."""
    c = pod["spec"]["containers"][0]
    cname = container_runner.container_name(pod, c["name"])
    info = json.loads(podman("inspect", cname).stdout)[0]
    # The operator put the chart's engine image in the pod; that (local) image is what runs.
    assert info["Image"] == container_runner.image_id(engine_image)
    assert container_runner.local_image(c["image"]) in (c["image"], engine_image)
    pod_sc = pod["spec"]["securityContext"]
    assert info["Config"]["User"] == f"{pod_sc['runAsUser']}:{pod_sc['runAsGroup']}"
    assert info["HostConfig"]["ReadonlyRootfs"] is c["securityContext"]["readOnlyRootFilesystem"] is True
    # The pod's command is the entrypoint and its args the container's, but for the bind address.
    entrypoint = info["Config"]["Entrypoint"]  # podman 4.3 shows it joined by spaces
    assert entrypoint in (c["command"], " ".join(c["command"])), entrypoint
    host = c["args"].index("--host") + 1
    got = info["Config"]["Cmd"]
    assert got[host] == pod["status"]["podIP"] and c["args"][host] == "0.0.0.0"
    kv = c["args"].index("--kv-cache-memory") + 1
    assert {i for i, (a, b) in enumerate(zip(got, c["args"], strict=True)) if a != b} <= {host, kv}
    env = dict(e.split("=", 1) for e in info["Config"]["Env"])
    for e in c["env"]:
        if "value" in e:
            assert env[e["name"]] == e["value"], e  # as written: the container has the pod's paths
    mounts = {m["Destination"] for m in info["Mounts"]}
    assert {m["mountPath"] for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"} <= mounts

    run = pod_runner.worker(pod["metadata"]["namespace"], pod["metadata"]["name"]).containers[0]
    assert ("startup", False) in run.probe_log and ("readiness", True) in run.probe_log, run.probe_log
    assert condition(pod, "Ready")["status"] == "True"
    return cname


def completion(pod: dict) -> httpx.Response:
    args = pod["spec"]["containers"][0]["args"]
    model = args[args.index("--served-model-name") + 1]
    return httpx.post(f"http://{pod['status']['podIP']}:8000/v1/completions", timeout=600,
                      json={"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                            "temperature": 0})


def wait_containers_gone(cluster: Cluster, namespace: str, name: str) -> None:
    """Delete the InferenceService and wait until its pods are gone and no container of any of them (also
    one a ReplicaSet made while the service was being deleted) is left."""
    cluster.kubectl("delete", ISVC, name, "-n", namespace, "--wait=true", check=False)
    seen: set[str] = set()

    def gone() -> bool:
        pods = items(cluster, "pods", namespace, f"serving.tokenmill.dev/inferenceservice={name}")
        seen.update(p["metadata"]["uid"] for p in pods)
        return not pods and not any(
            podman("ps", "-aq", "--filter", f"label={container_runner.OWNER_LABEL}={uid}", check=False).stdout.strip()
            for uid in seen)

    wait_for(gone, f"the {name} pods and their engine containers to go", timeout=180)


def test_bundled_example_runs_in_the_engine_image(cluster: Cluster, operator: OperatorProcess,
                                                  pod_runner: PodRunner, images: dict[str, str],
                                                  namespace: str) -> None:
    isvc = in_podman(next(d for d in example("bundled-one-gpu.yaml", namespace) if d["kind"] == "InferenceService"))
    name = isvc["metadata"]["name"]
    apply(cluster, isvc)
    try:
        obj = wait_ready(cluster, namespace, name)
        [pod] = runner_pods(cluster, namespace, name)
        cname = assert_container_is_the_pod(pod, pod_runner, images["engine"])
        rsp = completion(pod)
        assert rsp.status_code == 200, rsp.text
        assert rsp.json()["usage"]["completion_tokens"] >= 1
        assert container_runner.written_outside_volumes(cname) == []  # nothing written outside the pod's volumes
        assert obj["status"]["conditions"]
        assert pod_runner.all_errors() == []
    finally:
        wait_containers_gone(cluster, namespace, name)


def test_autoscaled_and_quota_examples_run_in_the_engine_image(
        cluster: Cluster, operator: OperatorProcess, pod_runner: PodRunner, images: dict[str, str],
        namespaces) -> None:
    """autoscaled.yaml (1 replica) and quota-limited-namespace.yaml (2 of 4 replicas under the quota) at
    once: three engine containers. The autoscaler reads the containers' real /metrics at their pod IPs."""
    where = {}
    for file, tag in (("autoscaled.yaml", "auto"), ("quota-limited-namespace.yaml", "quota")):
        ns = namespaces(tag)
        docs = [in_podman(d) if d["kind"] == "InferenceService" else d for d in example(file, ns)]
        for d in docs:
            apply(cluster, d, ns)
        where[file] = (ns, next(d for d in docs if d["kind"] == "InferenceService")["metadata"]["name"])
    try:
        status = {}
        for file, (ns, name) in where.items():
            obj = wait_ready(cluster, ns, name)
            pods = runner_pods(cluster, ns, name)
            assert len(pods) == obj["status"]["desiredReplicas"], (file, obj["status"])
            for pod in pods:
                cname = assert_container_is_the_pod(pod, pod_runner, images["engine"])
                rsp = completion(pod)
                assert rsp.status_code == 200, (file, rsp.text)
                assert container_runner.written_outside_volumes(cname) == [], file
            status[file] = obj
        quota = status["quota-limited-namespace.yaml"]
        assert quota["status"]["desiredReplicas"] == 2 and condition(quota, "QuotaLimited")["status"] == "True"
        ns, name = where["autoscaled.yaml"]
        wait_for(lambda: (c := condition(get(cluster, ISVC, name, ns), "ScalingActive")) and c["status"] == "True"
                 and c, "ScalingActive=True from the engine containers' metrics", timeout=60)
        assert pod_runner.all_errors() == []
    finally:
        for ns, name in where.values():
            wait_containers_gone(cluster, ns, name)


def test_tensor_parallel_example_runs_its_ranks_in_the_engine_image(
        cluster: Cluster, operator: OperatorProcess, pod_runner: PodRunner, images: dict[str, str],
        namespace: str) -> None:
    """examples/bundled-tensor-parallel.yaml (TP 3 on one pod): one engine container whose engine core
    starts the two other ranks inside it (CPU, gloo over loopback, the pod's /dev/shm as the container's)."""
    from test_pod_runner import rank_processes

    [isvc] = [in_podman(d) for d in example("bundled-tensor-parallel.yaml", namespace)]
    name = isvc["metadata"]["name"]
    apply(cluster, isvc)
    try:
        obj = wait_ready(cluster, namespace, name)
        assert obj["status"]["sizing"]["tensorParallelSize"] == 3, obj["status"]["sizing"]
        [pod] = runner_pods(cluster, namespace, name)
        cname = assert_container_is_the_pod(pod, pod_runner, images["engine"])
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "3"
        root = int(podman("inspect", "--format", "{{.State.Pid}}", cname).stdout)  # the container's PID 1
        ranks = rank_processes(root)
        assert sorted(ranks) == [1, 2], ranks
        rsp = completion(pod)
        assert rsp.status_code == 200, rsp.text
        assert rsp.json()["usage"]["completion_tokens"] >= 1
        assert set(rank_processes(root)) == {1, 2}  # the ranks served it and are still up
        assert container_runner.written_outside_volumes(cname) == []
        assert pod_runner.all_errors() == []
    finally:
        wait_containers_gone(cluster, namespace, name)
