"""Fixtures for the e2e tests: one real control plane per session, one namespace per test.

The cluster starts on first use (building the tools first if they are not cached) and stops at the
end of the session, also when tests fail. Set TOKENMILL_E2E_WORKDIR=.e2e to run the tests against a
cluster started by `make cluster-up` instead (it is then left running).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import (
    REPO,
    Cluster,
    ClusterError,
    Tools,
    ensure_tools,
    load_cluster,
    start_cluster,
    stop_processes,
)
from e2e_helpers import (
    CHART,
    OPERATOR_NAMESPACE,
    RELEASE,
    OperatorProcess,
    apply,
    chart_operator_args,
    sa_kubeconfig,
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the tools (if not cached) before the first test, when the selected tests need them: a cold
    build takes many minutes and must not count against one test's timeout. Its log is shown live."""
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "tools" not in used:
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        try:
            ensure_tools()
        except ClusterError as e:  # each e2e test errors with it; the other tests still run
            _build_error.append(e)
        try:
            if used & {"lws_controller", "kueue"}:
                import lws_controller

                lws_controller.build()
            if "kueue" in used:
                import kueue_controller

                kueue_controller.build()
        except ClusterError as e:  # the tests that need it error with it (their fixture builds again)
            print(f"[e2e] {e}", file=sys.stderr)
        if any("traffic" in getattr(item, "fixturenames", ()) for item in session.items):
            from traffic import ensure_epp

            with contextlib.suppress(ClusterError):  # test_traffic_tools.py's fixture retries and reports it
                ensure_epp()


_build_error: list[ClusterError] = []


@pytest.fixture(scope="session")
def tools() -> Tools:
    """The built binaries (kubectl, helm, ...) without starting a cluster."""
    if _build_error:
        raise _build_error[0]
    return ensure_tools()


@pytest.fixture(scope="session")
def cluster(tools: Tools) -> Iterator[Cluster]:
    reuse = os.environ.get("TOKENMILL_E2E_WORKDIR")
    if reuse:
        yield load_cluster(Path(reuse))
        return
    workdir = REPO / ".e2e" / "pytest"
    workdir.mkdir(parents=True, exist_ok=True)
    stop_processes(workdir)  # a previous session killed hard may have left its processes recorded
    c = start_cluster(workdir, tools=tools)
    try:
        yield c
    finally:
        stop_processes(workdir)


@pytest.fixture(scope="session")
def kueue(cluster: Cluster) -> int:
    """Kueue's controller manager (e2e/kueue_controller.py), and the LWS controller before it, for the rest
    of the session; returns Kueue's PID. From then on every Deployment, StatefulSet, LeaderWorkerSet, Job
    and pod outside kube-system passes Kueue's webhooks, as in a cluster that runs Kueue."""
    import kueue_controller

    return kueue_controller.start(cluster)


@pytest.fixture
def priorities(cluster: Cluster, namespace: str) -> Iterator[tuple[str, str]]:
    """A low (100) and a high (1000) Kueue WorkloadPriorityClass named for the test's namespace."""
    low, high = f"low-{namespace}", f"high-{namespace}"
    for name, value in ((low, 100), (high, 1000)):
        apply(cluster, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                        "metadata": {"name": name}, "value": value})
    try:
        yield low, high
    finally:
        cluster.kubectl("delete", "workloadpriorityclass", low, high, "--ignore-not-found", check=False)


@pytest.fixture(scope="session")
def api(cluster: Cluster):
    """A kubernetes ApiClient with the admin credentials."""
    from kubernetes import config

    client = config.new_client_from_config(str(cluster.kubeconfig))
    yield client
    client.close()


def _namespace_name(nodeid: str) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", nodeid.split("::")[-1].lower()).strip("-")[:40].strip("-")
    return f"{base}-{secrets.token_hex(3)}"


def delete_namespace(cluster: Cluster, name: str, timeout: float = 120) -> None:
    """Delete and wait until it is gone, so a failed test leaves nothing behind for the next one."""
    cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.kubectl("get", "namespace", name, check=False).returncode != 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"namespace {name} still exists {timeout:.0f}s after deletion")


def create_namespace(cluster: Cluster, name: str) -> str:
    cluster.kubectl("create", "namespace", name)
    # Pods need the namespace's default ServiceAccount, which the controller-manager adds.
    deadline = time.monotonic() + 60
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"no default ServiceAccount in {name} after 60s"
        time.sleep(0.2)
    return name


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted (and waited for) even when the test fails."""
    name = create_namespace(cluster, _namespace_name(request.node.nodeid))
    try:
        yield name
    finally:
        delete_namespace(cluster, name)


@pytest.fixture
def namespaces(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator:
    """A factory for more namespaces in one test; all are deleted at its end."""
    made: list[str] = []

    def make(tag: str) -> str:
        made.append(create_namespace(cluster, _namespace_name(f"{request.node.name}-{tag}")))
        return made[-1]

    try:
        yield make
    finally:
        for name in made:
            delete_namespace(cluster, name)


@pytest.fixture(scope="module")
def module_namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """One namespace for a module of tests that create nothing lasting (e.g. refused manifests)."""
    name = create_namespace(cluster, _namespace_name(request.module.__name__))
    try:
        yield name
    finally:
        delete_namespace(cluster, name)


# ---------------------------------------------------------------- the chart and the operator

@pytest.fixture(scope="session")
def chart_release(cluster: Cluster) -> Iterator[str]:
    """`helm install` of the chart (cluster-wide mode) into a namespace that enforces the restricted
    Pod Security Standard: the operator pod is only admitted if its security context complies."""
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    cluster.kubectl("label", "namespace", OPERATOR_NAMESPACE, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/enforce-version=latest")
    cluster.helm("install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "120s")
    try:
        yield RELEASE
    finally:
        cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", check=False)
        delete_namespace(cluster, OPERATOR_NAMESPACE)


@pytest.fixture(scope="session")
def hub_standin():
    """The Hub stand-in (tests/hub_standin.py) on loopback for the session; tests add their repos."""
    from hub_standin import HubStandin

    hub = HubStandin().start()
    try:
        yield hub
    finally:
        hub.stop()


@pytest.fixture(scope="session")
def operator(cluster: Cluster, chart_release: str):
    """The operator as a local process with the chart's arguments and its ServiceAccount's token:
    whatever it manages to do, the chart's RBAC allowed."""
    kubeconfig = sa_kubeconfig(cluster, OPERATOR_NAMESPACE, chart_release, cluster.workdir / "operator.kubeconfig")
    args = chart_operator_args(cluster, OPERATOR_NAMESPACE, chart_release)
    op = OperatorProcess(args, kubeconfig, cluster.workdir / "logs" / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="session")
def pod_runner(cluster: Cluster):
    """e2e/pod_runner.py for the session: pods labelled e2e.tokenmill.dev/pod-runner=true run their real
    containers as local processes (stopped, by PID, at the end)."""
    from pod_runner import PodRunner

    runner = PodRunner(cluster.kubeconfig, cluster.workdir)
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()
