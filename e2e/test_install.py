"""`helm install` of the chart, then the operator running with nothing but the chart's ServiceAccount:
what it manages to do proves the RBAC is enough; what it is refused proves it is not more."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import lws_controller
import pytest
from cluster import Cluster
from e2e_helpers import (
    CHART,
    ISVC,
    OPERATOR_NAMESPACE,
    OperatorProcess,
    apply,
    chart_operator_args,
    get,
    ready_for_current_generation,
    sa_kubeconfig,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

SERVICE = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "chat"},
    "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
             "resources": {"gpu": {"type": "nvidia-l4", "count": 1}}, "replicas": 1},
}


def kubectl_as(cluster: Cluster, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess:
    """kubectl with another identity's kubeconfig (the admin one is Cluster.kubectl's)."""
    return subprocess.run([str(cluster.tools.kubectl), f"--kubeconfig={kubeconfig}", *args],
                          capture_output=True, text=True, timeout=60)


def can_i(cluster: Cluster, sa: str, verb: str, resource: str, namespace: str | None = None) -> bool:
    resource, _, sub = resource.partition("/")  # "x/status": can-i wants the subresource as a flag
    args = ["auth", "can-i", verb, resource, f"--as=system:serviceaccount:{sa}",
            *([f"--subresource={sub}"] if sub else [])]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    out = cluster.kubectl(*args, check=False).stdout.strip()
    assert out in ("yes", "no"), out
    return out == "yes"


def test_helm_release_is_deployed_with_crds_and_a_running_operator_pod(cluster: Cluster, chart_release: str) -> None:
    status = json.loads(cluster.helm("status", chart_release, "-n", OPERATOR_NAMESPACE, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    for crd in ("inferenceservices.serving.tokenmill.dev", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        assert get(cluster, "crd", crd) is not None, crd
    deploy = get(cluster, "deployment", chart_release, OPERATOR_NAMESPACE)
    # Admitted under the namespace's `restricted` Pod Security enforcement and Ready (kwok runs it).
    assert deploy["status"]["readyReplicas"] == 1
    ns = get(cluster, "namespace", OPERATOR_NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_operator_works_with_the_chart_service_account_token(cluster: Cluster, operator: OperatorProcess,
                                                             namespace: str) -> None:
    kubeconfig = Path(next(a for a in operator.argv if a.startswith("--kubeconfig=")).split("=", 1)[1])
    who = json.loads(kubectl_as(cluster, kubeconfig, "auth", "whoami", "-o", "json").stdout)
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{OPERATOR_NAMESPACE}:tokenmill-operator"
    log_start = len(operator.log_text())
    apply(cluster, SERVICE, namespace)
    obj = wait_for(lambda: (o := get(cluster, ISVC, "chat", namespace)) and ready_for_current_generation(o) and o,
                   "Ready=True", timeout=90)
    # The children were written by the operator's field manager, i.e. with the ServiceAccount's rights.
    deploy = json.loads(cluster.kubectl("get", "deployment", "chat", "-n", namespace, "-o", "json",
                                        "--show-managed-fields").stdout)
    assert "tokenmill-operator" in {m["manager"] for m in deploy["metadata"]["managedFields"]}
    assert obj["status"]["conditions"]
    new_log = operator.log_text()[log_start:]
    assert "Forbidden" not in new_log and " 403" not in new_log, new_log[-3000:]

    # The chart's --metrics-port serves the operator's own metrics; the reconciles above were counted.
    assert operator.metrics_port, "the chart did not enable --metrics-port"
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as rsp:
        text = rsp.read().decode()
    samples = {(s.name, s.labels.get("result")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples.get(("tokenmill_operator_reconciles_total", "ok"), 0) >= 1, sorted(samples)[:20]


SA = f"{OPERATOR_NAMESPACE}:tokenmill-operator"


@pytest.mark.parametrize(("verb", "resource"), [
    ("get", "secrets"), ("list", "secrets"), ("list", "configmaps"), ("create", "pods"), ("delete", "pods"),
    ("update", "deployments"), ("update", "inferenceservices.serving.tokenmill.dev"),
    ("patch", "inferenceservices.serving.tokenmill.dev"), ("get", "nodes"), ("create", "clusterroles"),
    ("escalate", "roles"), ("create", "serviceaccounts/token"), ("delete", "services"),
    ("update", "inferenceservices.serving.tokenmill.dev/status"),
])
def test_cluster_wide_operator_is_refused_what_it_does_not_need(cluster: Cluster, chart_release: str,
                                                                verb: str, resource: str) -> None:
    # The router's ConfigMap and Service (spec.routing) need these two, granted only with the chart's routing
    # rules (rbac.routing: auto, i.e. once the InferencePool API is served, as after test_routing.py's upgrade).
    role = get(cluster, "clusterrole", chart_release)
    routing = any("inferencepools" in r.get("resources", []) for r in role["rules"])
    expected = routing and (verb, resource) in (("get", "configmaps"), ("delete", "services"))
    assert can_i(cluster, SA, verb, resource) == expected


@pytest.mark.parametrize(("verb", "resource"), [
    ("watch", "inferenceservices.serving.tokenmill.dev"), ("patch", "inferenceservices.serving.tokenmill.dev/status"),
    ("create", "deployments.apps"), ("patch", "deployments.apps"), ("list", "pods"), ("list", "resourcequotas"),
    ("create", "events"), ("delete", "poddisruptionbudgets.policy"), ("patch", "services"),
    ("get", "configmaps"), ("patch", "configmaps"),  # spec.model.lora's ConfigMap of adapters
    ("update", "inferenceservices.serving.tokenmill.dev/finalizers"),
    # A plan moving between one node and several replaces a Deployment by a LeaderWorkerSet or back.
    ("delete", "deployments.apps"), ("patch", "leaderworkersets.leaderworkerset.x-k8s.io"),
    ("delete", "leaderworkersets.leaderworkerset.x-k8s.io"),
])
def test_cluster_wide_operator_may_do_what_it_needs(cluster: Cluster, chart_release: str,
                                                    verb: str, resource: str) -> None:
    if resource.endswith(".leaderworkerset.x-k8s.io"):
        # can-i maps a group-qualified resource only while the API serves it: install the CRD first.
        lws_controller.install_crd(cluster)
    assert can_i(cluster, SA, verb, resource)


def test_operator_token_cannot_read_secrets_in_other_namespaces(cluster: Cluster, operator: OperatorProcess,
                                                                namespace: str) -> None:
    """With the real token, not just `can-i`: the API server refuses the request."""
    cluster.kubectl("create", "secret", "generic", "db-password", "-n", namespace, "--from-literal=pw=hunter2")
    kubeconfig = Path(next(a for a in operator.argv if a.startswith("--kubeconfig=")).split("=", 1)[1])
    proc = kubectl_as(cluster, kubeconfig, "get", "secret", "db-password", "-n", namespace, "-o", "json")
    assert proc.returncode != 0
    assert "Forbidden" in proc.stderr and "cannot get resource \"secrets\"" in proc.stderr, proc.stderr
    assert "hunter2" not in proc.stdout
    # The one name the chart's default grants (rbac.secretNames: the Hugging Face token), by name only.
    cluster.kubectl("create", "secret", "generic", "hf-token", "-n", namespace, "--from-literal=HF_TOKEN=hf_x")
    assert kubectl_as(cluster, kubeconfig, "get", "secret", "hf-token", "-n", namespace, "-o", "name").returncode == 0
    listed = kubectl_as(cluster, kubeconfig, "get", "secrets", "-n", namespace)
    assert listed.returncode != 0 and "cannot list resource \"secrets\"" in listed.stderr, listed.stderr


def test_namespaced_mode_operator_serves_only_its_namespaces(cluster: Cluster, operator: OperatorProcess,
                                                             namespaces, tmp_path: Path) -> None:
    """A second release in namespaced mode: Role/RoleBinding in the watched namespace only, and an operator
    with that ServiceAccount serves it and nothing else (the cluster-wide one is paused meanwhile)."""
    watched, other, home = namespaces("watched"), namespaces("other"), namespaces("home")
    cluster.helm("install", "tm-ns", str(CHART), "-n", home, "--wait", "--timeout", "120s",
                 "--set", f"watchNamespaces={{{watched}}}", "--skip-crds")
    sa = f"{home}:tm-ns-tokenmill-operator"
    assert get(cluster, "clusterrole", "tm-ns-tokenmill-operator") is None
    assert get(cluster, "role", "tm-ns-tokenmill-operator", watched) is not None
    assert can_i(cluster, sa, "watch", "inferenceservices.serving.tokenmill.dev", watched)
    assert can_i(cluster, sa, "get", "secrets", watched)  # rbac.readSecrets: for the apiKeySecretRef check
    for ns in (other, home, "default"):
        assert not can_i(cluster, sa, "get", "secrets", ns)
        assert not can_i(cluster, sa, "list", "inferenceservices.serving.tokenmill.dev", ns)
    assert not can_i(cluster, sa, "list", "inferenceservices.serving.tokenmill.dev")  # not cluster-wide

    kubeconfig = sa_kubeconfig(cluster, home, "tm-ns-tokenmill-operator", tmp_path / "kubeconfig")
    scoped = OperatorProcess(chart_operator_args(cluster, home, "tm-ns-tokenmill-operator"), kubeconfig,
                             tmp_path / "operator.log")
    assert f"--namespace={watched}" in scoped.argv
    operator.stop()
    try:
        scoped.start()
        apply(cluster, SERVICE, watched)
        apply(cluster, SERVICE, other)
        wait_for(lambda: ready_for_current_generation(get(cluster, ISVC, "chat", watched)),
                 "Ready=True in the watched namespace", timeout=90)
        assert get(cluster, "deployment", "chat", other) is None
        assert not (get(cluster, ISVC, "chat", other).get("status") or {}).get("conditions")
        log = scoped.log_text()
        assert "Forbidden" not in log and " 403" not in log, log[-3000:]
    finally:
        scoped.stop()
        cluster.helm("uninstall", "tm-ns", "-n", home, "--wait", check=False)
        operator.start()
