"""Two operator replicas (chart replicaCount=2): Kopf peering lets exactly one act, and the standby takes
over when the active one stops."""

from __future__ import annotations

from pathlib import Path

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
    wait_for,
)

SERVICE = {
    "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "chat"},
    "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
             "resources": {"gpu": {"type": "nvidia-h100-80gb", "count": 1}}, "replicas": 1},
}
ACTED = "Created: Deployment chat"


def acting(replica: OperatorProcess) -> bool:
    """Kopf starts every peered operator paused and logs each switch; the last one says where it is."""
    log = replica.log_text()
    return log.rfind("Resuming operations") > log.rfind("Pausing operations")


def test_two_replicas_elect_one_and_fail_over(cluster: Cluster, operator: OperatorProcess, chart_release: str,
                                              namespace: str, tmp_path: Path) -> None:
    cluster.helm("upgrade", chart_release, str(CHART), "-n", OPERATOR_NAMESPACE, "--reuse-values",
                 "--set", "replicaCount=2", "--wait", "--timeout", "120s")
    replicas: list[OperatorProcess] = []
    operator.stop()  # standalone, it would not take part in the peering
    try:
        args = chart_operator_args(cluster, OPERATOR_NAMESPACE, chart_release)
        peering = next(a for a in args if a.startswith("--peering=")).split("=", 1)[1]
        assert get(cluster, "clusterkopfpeering", peering) is not None  # created by the chart
        kubeconfig = Path(next(a for a in operator.argv if a.startswith("--kubeconfig=")).split("=", 1)[1])
        for i in range(2):
            replicas.append(OperatorProcess(args, kubeconfig, tmp_path / f"operator-{i}.log").start())

        # Both keep a heartbeat in the peering object (status: identity -> priority, lastseen, lifetime).
        wait_for(lambda: len((get(cluster, "clusterkopfpeering", peering) or {}).get("status") or {}) == 2,
                 "two peers in the ClusterKopfPeering", timeout=60)
        wait_for(lambda: [acting(r) for r in replicas].count(True) == 1, "exactly one acting replica", timeout=60)

        apply(cluster, SERVICE, namespace)
        wait_for(lambda: ready_for_current_generation(get(cluster, ISVC, "chat", namespace)), "Ready=True", 90)
        acted = [r for r in replicas if ACTED in r.log_text()]
        assert len(acted) == 1, [r.log_tail() for r in replicas]
        active = acted[0]
        standby = next(r for r in replicas if r is not active)
        assert acting(active) and not acting(standby)

        # Fail-over: the active replica stops (it removes itself from the peering on a clean exit).
        active.stop()
        wait_for(lambda: acting(standby), "the standby to resume", timeout=90)
        cluster.kubectl("patch", ISVC, "chat", "-n", namespace, "--type=merge", "-p", '{"spec": {"replicas": 2}}')
        wait_for(lambda: (o := get(cluster, ISVC, "chat", namespace))["metadata"]["generation"] == 2
                 and ready_for_current_generation(o), "the standby to reconcile generation 2", timeout=90)
        assert get(cluster, "deployment", "chat", namespace)["spec"]["replicas"] == 2
    finally:
        for r in replicas:
            r.stop()
        cluster.helm("upgrade", chart_release, str(CHART), "-n", OPERATOR_NAMESPACE, "--reuse-values",
                     "--set", "replicaCount=1", "--wait", "--timeout", "120s", check=False)
        operator.start()
