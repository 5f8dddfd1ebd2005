"""The local control plane itself: real versions, GPU nodes, scheduling, clean failure and shutdown."""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cluster import (
    BUILD_SCRIPT,
    COMPONENTS,
    DEFAULT_NODES,
    Cluster,
    ClusterError,
    ensure_tools,
    load_cluster,
    main,
    start_cluster,
)
from e2e_helpers import wait_for


def _script_default(var: str) -> str:
    m = re.search(rf'^{var}="\$\{{{var}:-([^}}]+)\}}"', BUILD_SCRIPT.read_text(), re.M)
    assert m, f"{var} not found in {BUILD_SCRIPT}"
    return m.group(1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_server_reports_the_stamped_version(cluster: Cluster) -> None:
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    want = _script_default("K8S_VERSION")
    assert out["serverVersion"]["gitVersion"] == want
    assert out["clientVersion"]["gitVersion"] == want
    assert out["serverVersion"]["minor"] == want.split(".")[1]
    helm = cluster.helm("version", "--short").stdout
    assert helm.startswith(_script_default("HELM_VERSION")), helm


def test_gpu_nodes_are_ready_with_capacity_and_product_label(cluster: Cluster) -> None:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assert set(by_name) == {n.name for n in DEFAULT_NODES}
    for spec in DEFAULT_NODES:
        node = by_name[spec.name]
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(spec.gpus)
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == spec.gpu_product
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
        # The controller-manager lifts the not-ready taint once kwok reports the node Ready.
        assert not [t for t in node["spec"].get("taints", []) if t["key"].startswith("node.kubernetes.io/")]
    # kwok renews a Lease per node: without leases its once-a-minute status heartbeat lets the node
    # lifecycle controller flip every node (and so every pod) NotReady now and then.
    leases = json.loads(cluster.kubectl("get", "leases", "-n", "kube-node-lease", "-o", "json").stdout)["items"]
    assert {lease["metadata"]["name"] for lease in leases} >= {n.name for n in DEFAULT_NODES}


def test_deployment_with_gpu_limits_rolls_out_and_respects_capacity(cluster: Cluster, namespace: str) -> None:
    """Controller-manager, scheduler and kwok together: GPU pods bind only where GPUs are free."""
    l4 = next(n for n in DEFAULT_NODES if n.gpu_product == "NVIDIA-L4")
    replicas = l4.gpus // 2 + 1  # one more 2-GPU pod than the L4 pool can hold
    deploy = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "gpu", "namespace": namespace},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "gpu"}}, "template": {
            "metadata": {"labels": {"app": "gpu"}},
            "spec": {"nodeSelector": {"nvidia.com/gpu.product": l4.gpu_product}, "containers": [{
                "name": "c", "image": "example.invalid/engine:1",
                "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(deploy))
    deadline = time.monotonic() + 90
    while True:
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        pending = [p for p in pods if p["status"].get("phase") == "Pending"]
        if len(running) == l4.gpus // 2 and len(pending) == 1:
            unsched = [c for c in pending[0]["status"].get("conditions", []) if c["type"] == "PodScheduled"]
            if unsched and unsched[0]["reason"] == "Unschedulable":
                break
        assert time.monotonic() < deadline, [(p["metadata"]["name"], p["status"].get("phase")) for p in pods]
        time.sleep(0.5)
    assert {p["spec"]["nodeName"] for p in running} == {l4.name}
    # Pod IPs come from kwok's loopback CIDR, so nothing that connects to a pod leaves the machine.
    # Each cluster draws its own /20 of 127.200.0.0-127.254.255.255 (clusters of several checkouts on one
    # machine must not hand out the same IP): every pod of this cluster lies in one such /20.
    nets = {ipaddress.ip_network(f"{p['status']['podIP']}/20", strict=False) for p in running}
    assert len(nets) == 1, nets
    net = nets.pop()
    assert net.subnet_of(ipaddress.ip_network("127.0.0.0/8")) and 200 <= net.network_address.packed[1] <= 254
    assert "nvidia.com/gpu" in unsched[0]["message"]


def test_failed_start_names_the_component_and_leaves_no_process(cluster: Cluster, tmp_path: Path) -> None:
    """A component that dies during start-up: the error names it and everything started is stopped."""
    broken = replace(cluster.tools, kube_scheduler=Path(shutil.which("false")))
    with pytest.raises(ClusterError, match=r"kube-scheduler exited with code 1"):
        start_cluster(tmp_path, tools=broken, timeout=60)
    state = json.loads((tmp_path / "cluster.json").read_text())
    assert state["processes"] == {}
    started = {p["exe"].rsplit("/", 1)[-1] for p in state["stopped"]}
    assert {"etcd", "kube-apiserver", "kube-controller-manager"} <= started
    assert not [p for p in state["stopped"] if _alive(p["pid"])]


def test_port_taken_is_refused_before_anything_starts(cluster: Cluster, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ClusterError, match=rf"port {port} on 127.0.0.1 is already in use.*kube-apiserver"):
            start_cluster(tmp_path, tools=cluster.tools, ports={"kube-apiserver": port})
    assert not (tmp_path / "cluster.json").exists() or json.loads(
        (tmp_path / "cluster.json").read_text())["processes"] == {}


def test_cluster_up_and_down_cli_stop_every_process(cluster: Cluster, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["up", "--workdir", str(tmp_path)]) == 0
    assert f"KUBECONFIG={tmp_path / 'kubeconfig'}" in capsys.readouterr().out
    state = json.loads((tmp_path / "cluster.json").read_text())
    pids = [p["pid"] for p in state["processes"].values()]
    # The control plane, then the LWS controller and Kueue beside it (so a ClusterQueue can be applied), then
    # the pod runner as the cluster's kubelet.
    assert list(state["processes"]) == [*COMPONENTS, "lws-controller", "kueue", "pod-runner"]
    assert all(_alive(p) for p in pids)
    # Kubelet mode: a pod whose command exists here runs as a process; one that needs its image's entrypoint
    # is only marked running (as kwok did); neither carries the pod-runner label.
    up = load_cluster(tmp_path)
    for name, command in (("runs", ["sleep", "300"]), ("entrypoint", None)):
        container = {"name": "c", "image": "example.org/x:1", **({"command": command} if command else {})}
        up.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": "default"}, "spec": {"containers": [container]}}))

    def statuses() -> dict[str, dict] | None:
        pods = json.loads(up.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
        found = {p["metadata"]["name"]: p["status"] for p in pods}
        ready = all(any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
                    for st in found.values())
        return found if len(found) == 2 and ready else None

    found = wait_for(statuses, "both pods Ready in kubelet mode", timeout=60)
    pid = int(found["runs"]["containerStatuses"][0]["containerID"].removeprefix("e2e-runner://"))
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert Path(argv[0].decode()).name == "sleep" and argv[1] == b"300"
    assert "containerID" not in found["entrypoint"]["containerStatuses"][0]
    # A second `up` on the same workdir refuses instead of starting a second set of processes.
    assert main(["up", "--workdir", str(tmp_path)]) == 1
    assert "still running" in capsys.readouterr().err
    assert main(["down", "--workdir", str(tmp_path)]) == 0
    assert not [p for p in pids if _alive(p)]
    assert main(["down", "--workdir", str(tmp_path)]) == 0
    assert "nothing was running" in capsys.readouterr().out


def test_build_failure_is_a_clear_error(tmp_path: Path) -> None:
    bogus = "v0.0.0-no-such-version"
    with pytest.raises(ClusterError, match=r"building the cluster tools failed") as err:
        ensure_tools(env={"KWOK_VERSION": bogus})
    assert f"sigs.k8s.io/kwok/cmd/kwok@{bogus}" in str(err.value)
    assert not (Path.home() / ".cache" / "tokenmill" / "kwok" / bogus).exists()
