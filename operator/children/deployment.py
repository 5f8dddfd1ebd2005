"""The Deployment of a single-node InferenceService: `replicas` engine pods, replaced one at a time."""

from tokenmill.operator.children.meta import selector_labels, stamp, workload_metadata
from tokenmill.operator.children.pod import pod_template
from tokenmill.operator.plan.sizing import SizingPlan
from tokenmill.operator.plan.spec import ServiceSpec
from tokenmill.operator.plan.startup import startup_timeout_seconds


def desired_deployment(spec: ServiceSpec, plan: SizingPlan, replicas: int, image: str,
                       hf_endpoint: str | None = None) -> dict:
    startup = startup_timeout_seconds(spec, plan)
    return stamp({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": workload_metadata(spec),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # GPUs are scarce and quota-capped: replace pods one at a time instead of surging an extra
            # replica that may find no free GPU or no quota (a stuck rollout).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            # The Deployment must not call a slow model load a failed rollout.
            "progressDeadlineSeconds": startup + 300,
            "revisionHistoryLimit": 3,
            "template": pod_template(spec, plan, image, hf_endpoint),
        },
    })

