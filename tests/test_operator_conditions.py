from tokenmill.operator.plan.conditions import (
    CONDITION_TYPES,
    Condition,
    Facts,
    Rollout,
    compute_conditions,
    pod_problem,
    rollout_from,
)
from tokenmill.operator.status import merge_conditions, transition_events

SIZED = Condition("Sized", "True", "Fits", "1 x nvidia-l4 per replica")
NO_QUOTA = Condition("QuotaLimited", "False", "NoGPUQuota", "no ResourceQuota limits nvidia.com/gpu")
FIXED = Condition("ScalingActive", "False", "FixedReplicas", "spec.replicas is 2")


def by_type(conds) -> dict:
    return {c.type: c for c in conds}


def facts(**kw) -> Facts:
    base = {"sized": SIZED, "quota": NO_QUOTA, "scaling": FIXED, "endpoint": "http://chat.ns.svc:8000/v1"}
    return Facts(**{**base, **kw})


def test_all_six_conditions_always_present():
    conds = compute_conditions(facts(rollout=Rollout(True, 2, 2, 2, 2)))
    assert [c.type for c in conds] == list(CONDITION_TYPES)
    assert all(c.reason and c.message for c in conds)


def test_ready_when_every_replica_is_ready():
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 2, replicas=2, ready=2, updated=2))))
    assert (c["Ready"].status, c["Ready"].reason) == ("True", "Available")
    assert "2/2 replicas ready at http://chat.ns.svc:8000/v1" == c["Ready"].message
    assert c["Reconciling"].status == "False" and c["Stalled"].status == "False"


def test_rolling_out_is_reconciling():
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 2, replicas=2, ready=1, updated=1))))
    assert (c["Reconciling"].status, c["Reconciling"].reason) == ("True", "RollingOut")
    assert c["Ready"].status == "False" and c["Stalled"].status == "False"
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 2, 2, 2, 2, observed_current=False))))
    assert c["Reconciling"].status == "True"  # the Deployment controller has not seen the new spec yet
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 1, replicas=3, ready=3, updated=3))))
    assert c["Reconciling"].reason == "ScalingDown"


def test_infeasible_is_stalled_not_reconciling():
    bad = Condition("Sized", "False", "WeightsDoNotFit", "Llama-3.1-70B in bfloat16 needs 141 GB of weights")
    c = by_type(compute_conditions(facts(sized=bad, rollout=None, quota=None, scaling=None)))
    assert (c["Stalled"].status, c["Stalled"].reason) == ("True", "WeightsDoNotFit")
    assert c["Reconciling"].status == "False"
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "WeightsDoNotFit")
    assert c["Sized"] == bad


def test_spec_error():
    c = by_type(compute_conditions(Facts(spec_error="spec.replicas must be at least 0, got -1")))
    assert (c["Stalled"].status, c["Stalled"].reason) == ("True", "InvalidSpec")
    assert c["Sized"].status == "Unknown" and "spec.replicas" in c["Ready"].message


def test_missing_secret_blocks():
    c = by_type(compute_conditions(facts(blocker=("SecretNotFound", "Secret chat-keys (spec.apiKeySecretRef) not found"),
                                         rollout=Rollout(False, 1))))
    assert (c["Stalled"].status, c["Stalled"].reason) == ("True", "SecretNotFound")
    assert "chat-keys" in c["Stalled"].message


def test_quota_exhausted_is_stalled_and_partial_quota_still_ready():
    limited = Condition("QuotaLimited", "True", "GPUQuotaExceeded", "ResourceQuota gpu ... capped at 0")
    c = by_type(compute_conditions(facts(quota=limited, rollout=Rollout(True, 0))))
    assert (c["Stalled"].status, c["Stalled"].reason) == ("True", "QuotaExhausted")
    part = Condition("QuotaLimited", "True", "GPUQuotaExceeded", "capped at 1")
    c = by_type(compute_conditions(facts(quota=part, rollout=Rollout(True, 1, 1, 1, 1))))
    assert c["Ready"].status == "True" and c["QuotaLimited"].status == "True"


def test_scaled_to_zero_on_request_is_ready():
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 0))))
    assert (c["Ready"].status, c["Ready"].reason) == ("True", "ScaledToZero")


def pod(name, **status):
    return {"metadata": {"name": name}, "status": status}


def test_pod_problems():
    unsched = pod("a", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
    text, blocked = pod_problem([unsched])
    assert text == "pod a: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." and not blocked
    secret = pod("b", containerStatuses=[{"state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                "message": 'secret "chat-keys" not found'}}}])
    text, blocked = pod_problem([secret])
    assert blocked and 'secret "chat-keys" not found' in text
    creating = pod("c", containerStatuses=[{"state": {"waiting": {"reason": "ContainerCreating"}}}])
    assert pod_problem([creating]) == (None, False)


def test_rollout_from_deployment_and_blocked_pods():
    dep = {"metadata": {"generation": 3}, "status": {"observedGeneration": 3, "replicas": 2, "readyReplicas": 1,
                                                     "updatedReplicas": 2, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "chat-1" has timed out progressing.'}]}}
    r = rollout_from(dep, 2, [])
    assert (r.replicas, r.ready, r.updated, r.observed_current) == (2, 1, 2, True)
    c = by_type(compute_conditions(facts(rollout=r)))
    assert (c["Stalled"].status, c["Stalled"].reason) == ("True", "ProgressDeadlineExceeded")
    bad = pod("x", containerStatuses=[{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}])
    c = by_type(compute_conditions(facts(rollout=rollout_from({"metadata": {}, "status": {}}, 1, [bad]))))
    assert (c["Stalled"].status, c["Stalled"].reason) == ("True", "PodsBlocked")


def test_last_transition_time_moves_only_on_status_change():
    first = merge_conditions(None, compute_conditions(facts(rollout=Rollout(True, 2, 2, 1, 1))), 4, "T1")
    ready1 = next(c for c in first if c["type"] == "Ready")
    assert ready1["lastTransitionTime"] == "T1" and ready1["observedGeneration"] == 4
    second = merge_conditions(first, compute_conditions(facts(rollout=Rollout(True, 2, 2, 1, 2))), 5, "T2")
    ready2 = next(c for c in second if c["type"] == "Ready")
    assert ready2["lastTransitionTime"] == "T1" and ready2["observedGeneration"] == 5  # still False
    third = merge_conditions(second, compute_conditions(facts(rollout=Rollout(True, 2, 2, 2, 2))), 5, "T3")
    assert next(c for c in third if c["type"] == "Ready")["lastTransitionTime"] == "T3"
    assert set(third[0]) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}


def test_events_on_transitions_only():
    start = compute_conditions(facts(rollout=Rollout(True, 2, 2, 0, 2)))
    events = transition_events(None, start)
    assert [e[1] for e in events] == ["Fits"]  # a first Sized is news; Creating/WaitingForReplicas is not
    prev = merge_conditions(None, start, 1, "T")
    ready = compute_conditions(facts(rollout=Rollout(True, 2, 2, 2, 2)))
    assert transition_events(prev, ready) == [("Normal", "Available", "Ready=True: 2/2 replicas ready at http://chat.ns.svc:8000/v1")]
    prev = merge_conditions(prev, ready, 1, "T")
    assert transition_events(prev, ready) == []
    limited = compute_conditions(facts(quota=Condition("QuotaLimited", "True", "GPUQuotaExceeded", "capped at 1"),
                                       rollout=Rollout(True, 1, 1, 1, 1)))
    kinds = {e[1]: e[0] for e in transition_events(prev, limited)}
    assert kinds == {"GPUQuotaExceeded": "Warning"}
    missing = Condition("ScalingActive", "False", "MetricsMissing", "holding")
    kinds = {e[1]: e[0] for e in transition_events(prev, compute_conditions(facts(scaling=missing, rollout=Rollout(True, 2, 2, 2, 2))))}
    assert kinds == {"MetricsMissing": "Warning"}


def test_autoscaler_adding_replicas_is_operation_not_a_rollout():
    # autoscaled (minReplicas 1): 3 desired, 1 ready, all pods on the current template
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 3, replicas=3, ready=1, updated=3, floor=1))))
    assert (c["Ready"].status, c["Reconciling"].status) == ("True", "False")
    assert "1/3 replicas ready (scaling up)" in c["Ready"].message
    # a fixed size of 3 with 1 ready is still on its way
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 3, replicas=3, ready=1, updated=3))))
    assert (c["Ready"].status, c["Reconciling"].reason) == ("False", "WaitingForReplicas")
    # old-template pods left: a rollout, autoscaled or not
    c = by_type(compute_conditions(facts(rollout=Rollout(True, 3, replicas=3, ready=3, updated=1, floor=1))))
    assert c["Reconciling"].reason == "RollingOut"


def test_a_pure_scale_is_not_mistaken_for_a_rollout():
    dep = {"metadata": {"generation": 5}, "status": {"observedGeneration": 4, "replicas": 2, "readyReplicas": 2,
                                                     "updatedReplicas": 2}}
    assert rollout_from(dep, 2, [], spec_changed=True).observed_current is False
    assert rollout_from(dep, 2, [], spec_changed=False).observed_current is True
