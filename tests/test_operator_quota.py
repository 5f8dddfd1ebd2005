from fractions import Fraction

import pytest
from tokenmill.operator.plan.quota import cap_replicas, parse_quantity, pod_gpus, quota_applies


def quota(name="gpu", hard="8", used="0", key="requests.nvidia.com/gpu", **spec) -> dict:
    return {"metadata": {"name": name}, "spec": {"hard": {key: hard}, **spec},
            "status": {"hard": {key: hard}, "used": {key: used}}}


def pod(gpus: int, phase="Running", limits_only=False, name="p") -> dict:
    res = {"limits": {"nvidia.com/gpu": str(gpus)}} if limits_only else {
        "requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "engine", "resources": res}]},
            "status": {"phase": phase}}


@pytest.mark.parametrize(("text", "value"), [
    ("4", 4), ("500m", Fraction(1, 2)), ("1Gi", 2**30), ("32Gi", 32 * 2**30), ("1e3", 1000), ("2k", 2000), (3, 3),
])
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


def test_bad_quantity():
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity("4 GPUs")


def test_pod_gpus_from_requests_or_limits():
    assert pod_gpus(pod(2)) == 2
    assert pod_gpus(pod(4, limits_only=True)) == 4  # extended resources default their request to the limit
    assert pod_gpus({"spec": {"containers": [{"name": "c"}]}}) == 0


def test_cap_counts_own_pods_as_headroom():
    # hard 8, used 8 of which our 2 pods x 2 GPUs = 4: we may have (8 - 8 + 4) / 2 = 2 replicas
    cap = cap_replicas(4, 2, [quota(hard="8", used="8")], [pod(2, name="a"), pod(2, name="b")])
    assert cap.limited and cap.max_replicas == 2
    assert "hard 8, used 8 of which 4 by this service" in cap.message
    assert "admits 2 replicas x 2 GPUs; wanted 4: capped at 2" in cap.message


def test_within_quota():
    cap = cap_replicas(3, 1, [quota(hard="10", used="2")], [])
    assert not cap.limited and cap.max_replicas == 8
    assert "3 fit" in cap.message


def test_no_quota():
    cap = cap_replicas(3, 1, [], [])
    assert cap.max_replicas is None and not cap.limited and "no ResourceQuota" in cap.message
    cpu_only = {"metadata": {"name": "cpu"}, "spec": {"hard": {"requests.cpu": "10"}}, "status": {"hard": {"requests.cpu": "10"}}}
    assert cap_replicas(3, 1, [cpu_only], []).max_replicas is None


def test_tightest_quota_wins_and_finished_pods_do_not_count():
    quotas = [quota("a", hard="16", used="4"), quota("b", hard="6", used="5", key="limits.nvidia.com/gpu")]
    # b: 6 - 5 + our 1 running GPU (the Succeeded pod is not charged) = 2
    cap = cap_replicas(5, 1, quotas, [pod(1), pod(1, phase="Succeeded")])
    assert cap.max_replicas == 2 and "ResourceQuota b" in cap.message


def test_zero_headroom():
    cap = cap_replicas(1, 1, [quota(hard="4", used="4")], [])
    assert cap.max_replicas == 0 and cap.limited


def test_used_missing_means_only_our_pods():
    q = {"metadata": {"name": "new"}, "spec": {"hard": {"requests.nvidia.com/gpu": "2"}}, "status": {}}
    assert cap_replicas(4, 1, [q], [pod(1)]).max_replicas == 2


def test_a_stale_used_never_counts_our_pods_twice():
    # The quota was just created: its status still says used 0 while our 2 one-GPU pods run. Headroom
    # is hard 2 - 2 (ours, the floor for used) + 2 (ours, replaced rather than added) = 2 replicas, not 4.
    cap = cap_replicas(3, 1, [quota(hard="2", used="0")], [pod(1, name="a"), pod(1, name="b")])
    assert cap.max_replicas == 2 and cap.limited
    assert "used 2 of which 2 by this service" in cap.message


@pytest.mark.parametrize(("spec", "priority", "applies"), [
    ({}, None, True),
    ({"scopes": ["NotTerminating"]}, None, True),
    ({"scopes": ["Terminating"]}, None, False),
    ({"scopes": ["BestEffort"]}, None, False),
    ({"scopes": ["NotBestEffort"]}, None, True),
    ({"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]}}, "high", True),
    ({"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]}}, None, False),
    ({"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "NotIn", "values": ["low"]}]}}, "high", True),
    ({"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "Exists"}]}}, None, False),
])
def test_scopes(spec, priority, applies):
    assert quota_applies({"spec": spec}, priority) is applies


def test_scoped_quota_that_does_not_apply_is_ignored():
    q = quota(hard="0", used="0", scopes=["BestEffort"])
    assert cap_replicas(3, 1, [q], []).max_replicas is None
