"""Reconcile against a dict-backed fake of the Kubernetes API (the real API server is the e2e suite's)."""

import copy

import pytest
from tokenmill.operator import reconcile as rec
from tokenmill.operator.kube import KubeError, merge_patch
from tokenmill.operator.observe.hub import HubCache, HubError
from tokenmill.operator.plan.observations import PodReading

NS = "team-a"


class FakeApi:
    """The KubeApi methods reconcile uses, over dicts; records writes."""

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.pods: list[dict] = []
        self.quotas: list[dict] = []
        self.secrets: dict[str, set[str]] = {}
        self.secrets_forbidden = False
        self.writes: list[tuple] = []
        self.events: list[tuple[str, str, str]] = []

    def get(self, kind, ns, name):
        obj = self.objects.get((kind, ns, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, kind, ns, label_selector=None):
        if kind == "Pod":
            return copy.deepcopy(self.pods)
        if kind == "ResourceQuota":
            return copy.deepcopy(self.quotas)
        raise AssertionError(kind)

    def apply(self, obj, field_manager="tokenmill-operator"):
        assert obj["kind"] != "InferenceService", "the operator must never write the spec"
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.writes.append(("apply", *key))
        old = self.objects.get(key)
        new = copy.deepcopy(obj)
        gen = 1 if old is None else old["metadata"].get("generation", 1) + (old.get("spec") != obj.get("spec"))
        new["metadata"]["generation"] = gen
        new["status"] = (old or {}).get("status", {})
        self.objects[key] = new
        return copy.deepcopy(new)

    def delete(self, kind, ns, name):
        self.writes.append(("delete", kind, ns, name))
        self.objects.pop((kind, ns, name), None)

    def patch_status(self, ns, name, patch):
        self.writes.append(("status", ns, name))
        obj = self.objects[("InferenceService", ns, name)]
        obj["status"] = _merge(obj.get("status") or {}, patch)
        return copy.deepcopy(obj)

    def secret_keys(self, ns, name):
        if self.secrets_forbidden:
            raise KubeError(403, "secrets is forbidden")
        return self.secrets.get(name)

    def create_event(self, obj, type_, reason, message):
        self.events.append((type_, reason, message))

    def has_resource(self, group, version, plural):
        return False  # no LeaderWorkerSet or Kueue API here (tests/test_operator_kueue.py has Kueue's)


def _merge(old: dict, patch: dict) -> dict:
    out = dict(old)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def add_isvc(api: FakeApi, spec: dict, name="chat", generation=1) -> dict:
    body = {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": generation}, "spec": spec}
    api.objects[("InferenceService", NS, name)] = body
    return body


def offline(*a, **k):
    raise HubError("HubUnreachable", "no Hub in unit tests")


def run(api, name="chat", autoscale=False, now=1_000_000.0, config=None, **kw) -> dict:
    """One reconcile; no Hub is asked (hf:// models the catalog has proceed as with an unreachable Hub;
    the Hub lookups run against the Hub stand-in in tests/test_operator_hub.py)."""
    body = api.get("InferenceService", NS, name)
    config = config or rec.OperatorConfig(hub=HubCache(fetcher=offline))
    return rec.reconcile(api, body, config, autoscale=autoscale, now=now, **kw)


def smol(**extra):
    return {"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpu": {"type": "nvidia-l4"}}, **extra}


def cond(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def make_pods(api: FakeApi, n: int, ready=True, gpus=1):
    api.pods = [{
        "metadata": {"name": f"chat-{i}"},
        "spec": {"containers": [{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
        "status": {"phase": "Running", "podIP": f"10.0.0.{i}",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    } for i in range(n)]


def deployment_ready(api: FakeApi, name="chat"):
    dep = api.objects[("Deployment", NS, name)]
    n = dep["spec"]["replicas"]
    dep["status"] = {"observedGeneration": dep["metadata"]["generation"], "replicas": n, "readyReplicas": n,
                     "updatedReplicas": n}


def test_creates_children_and_writes_status():
    api = FakeApi()
    add_isvc(api, smol(replicas=2))
    status = run(api)
    assert {k[0] for k in api.objects} == {"InferenceService", "Deployment", "Service", "PodDisruptionBudget"}
    dep = api.objects[("Deployment", NS, "chat")]
    assert dep["spec"]["replicas"] == 2
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
    stored = api.objects[("InferenceService", NS, "chat")]
    assert stored["spec"] == smol(replicas=2)  # never written
    assert stored["status"]["observedGeneration"] == 1
    assert stored["status"]["sizing"]["kvTokens"] == 823_472 and stored["status"]["sizing"]["gpusPerReplica"] == 1
    assert stored["status"]["endpoint"] == "http://chat.team-a.svc:8000/v1"
    assert stored["status"]["selector"] == "serving.tokenmill.dev/inferenceservice=chat"
    assert (cond(status, "Sized")["status"], cond(status, "Reconciling")["status"]) == ("True", "True")
    assert cond(status, "Ready")["status"] == "False"
    assert {e[1] for e in api.events} >= {"Fits", "Created"}


def test_second_pass_changes_nothing_and_ready_follows_the_deployment():
    api = FakeApi()
    add_isvc(api, smol(replicas=2))
    run(api)
    deployment_ready(api)
    make_pods(api, 2)
    api.writes.clear()
    status = run(api)
    assert [w[0] for w in api.writes] == ["status"]  # only Ready flipped; no child was re-applied
    assert cond(status, "Ready")["status"] == "True" and cond(status, "Reconciling")["status"] == "False"
    api.writes.clear()
    run(api)
    assert api.writes == []  # steady state: no writes at all


def test_drift_is_corrected():
    api = FakeApi()
    add_isvc(api, smol(replicas=2))
    run(api)
    dep = api.objects[("Deployment", NS, "chat")]
    dep["spec"]["replicas"] = 7
    dep["spec"]["template"]["spec"]["containers"][0]["args"][-1] = "9999"
    api.objects.pop(("Service", NS, "chat"))
    run(api)
    dep = api.objects[("Deployment", NS, "chat")]
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "110"
    assert ("Service", NS, "chat") in api.objects


def test_infeasible_creates_nothing():
    api = FakeApi()
    add_isvc(api, {"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
                   "resources": {"gpu": {"type": "nvidia-l4", "count": 1}}})
    status = run(api)
    assert [k[0] for k in api.objects] == ["InferenceService"]
    sized = cond(status, "Sized")
    assert (sized["status"], sized["reason"]) == ("False", "WeightsDoNotFit")
    assert "needs 141 GB of weights; 1 x nvidia-l4 has 24.2 GB" in sized["message"]
    assert cond(status, "Stalled")["status"] == "True" and cond(status, "Ready")["status"] == "False"
    assert status["sizing"]["feasible"] is False
    assert ("Warning", "WeightsDoNotFit") in {(e[0], e[1]) for e in api.events}


def test_bad_edit_keeps_the_running_deployment():
    api = FakeApi()
    add_isvc(api, smol(replicas=1))
    run(api)
    before = copy.deepcopy(api.objects[("Deployment", NS, "chat")])
    body = api.objects[("InferenceService", NS, "chat")]
    body["spec"]["engine"] = {"maxModelLen": 100000}
    body["metadata"]["generation"] = 2
    status = run(api)
    assert cond(status, "Sized")["reason"] == "MaxModelLenTooLarge"
    assert api.objects[("Deployment", NS, "chat")] == before
    assert status["observedGeneration"] == 2


def test_unknown_model_says_what_to_add():
    api = FakeApi()
    add_isvc(api, {"model": {"uri": "pvc://models/my-finetune"}, "resources": {"gpu": {"type": "nvidia-l4"}}})
    status = run(api)
    sized = cond(status, "Sized")
    assert (sized["status"], sized["reason"]) == ("False", "UnknownModelProfile")
    assert "spec.model.profile" in sized["message"]
    assert ("Deployment", NS, "chat") not in api.objects


def test_profile_makes_an_unknown_model_servable():
    api = FakeApi()
    add_isvc(api, {"model": {"uri": "pvc://models/my-finetune", "profile": {"base": "Llama-3.1-8B"}},
                   "resources": {"gpu": {"type": "nvidia-a100-80gb"}}})
    status = run(api)
    assert cond(status, "Sized")["status"] == "True" and status["sizing"]["model"] == "Llama-3.1-8B"


def test_missing_secret_is_stalled_with_its_name():
    api = FakeApi()
    add_isvc(api, smol(apiKeySecretRef={"name": "chat-keys"}))
    status = run(api)
    stalled = cond(status, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "SecretNotFound")
    assert "Secret chat-keys" in stalled["message"]
    assert ("Deployment", NS, "chat") not in api.objects
    api.secrets["chat-keys"] = {"token"}
    assert "has no key 'api-key' (keys: token)" in cond(run(api), "Stalled")["message"]
    api.secrets["chat-keys"] = {"api-key"}
    status = run(api)
    assert cond(status, "Stalled")["status"] == "False" and ("Deployment", NS, "chat") in api.objects


def test_secret_check_skipped_when_forbidden():
    api = FakeApi()
    api.secrets_forbidden = True
    add_isvc(api, smol(apiKeySecretRef={"name": "chat-keys"}))
    run(api)
    assert ("Deployment", NS, "chat") in api.objects


def test_name_conflict_with_a_foreign_object():
    api = FakeApi()
    add_isvc(api, smol())
    api.objects[("Service", NS, "chat")] = {"kind": "Service", "metadata": {"name": "chat", "namespace": NS}}
    status = run(api)
    assert cond(status, "Stalled")["reason"] == "NameConflict"
    assert "Service chat already exists" in cond(status, "Stalled")["message"]
    assert ("Deployment", NS, "chat") not in api.objects


def gpu_quota(hard: int, used: int) -> dict:
    key = "requests.nvidia.com/gpu"
    return {"metadata": {"name": "gpus"}, "spec": {"hard": {key: str(hard)}},
            "status": {"hard": {key: str(hard)}, "used": {key: str(used)}}}


def test_quota_caps_fixed_replicas():
    api = FakeApi()
    api.quotas = [gpu_quota(hard=3, used=1)]  # someone else uses 1 GPU
    add_isvc(api, smol(replicas=5))
    status = run(api)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2
    q = cond(status, "QuotaLimited")
    assert (q["status"], q["reason"]) == ("True", "GPUQuotaExceeded")
    assert "hard 3, used 1 of which 0 by this service" in q["message"] and "capped at 2" in q["message"]
    assert status["desiredReplicas"] == 2
    # with our two pods running the quota reads used 3; the cap stays 2 (our own pods count as ours)
    make_pods(api, 2)
    api.quotas = [gpu_quota(hard=3, used=3)]
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2
    assert run(api)["desiredReplicas"] == 2


def test_quota_exhausted_scales_to_zero_and_stalls():
    api = FakeApi()
    api.quotas = [gpu_quota(hard=2, used=2)]
    add_isvc(api, smol(replicas=1))
    status = run(api)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 0
    assert cond(status, "Stalled")["reason"] == "QuotaExhausted"


def readings(depths: dict[str, float]):
    def scrape(pods, timeout):
        return {p["metadata"]["name"]: PodReading(running=depths[p["metadata"]["name"]],
                                                  capacity={"kvTokens": 823472.0, "modelLoadSeconds": 3.0})
                for p in pods if p["metadata"]["name"] in depths}
    return scrape


def autoscaled(api: FakeApi, **scaling):
    add_isvc(api, smol(scaling={"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 10, **scaling}))
    run(api)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1
    deployment_ready(api)


def test_autoscaler_scales_the_deployment_not_the_spec():
    api = FakeApi()
    autoscaled(api)
    make_pods(api, 1)
    status = run(api, autoscale=True, scrape=readings({"chat-0": 35}))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 4  # ceil(35 / 10)
    assert "replicas" not in api.objects[("InferenceService", NS, "chat")]["spec"]
    sa = cond(status, "ScalingActive")
    assert (sa["status"], sa["reason"]) == ("True", "MetricsAvailable")
    assert status["scaling"]["currentQueueDepth"] == 35 and status["scaling"]["targetQueueDepth"] == 10
    assert status["scaling"]["recommendations"][-1]["replicas"] == 4
    assert any(e[1] == "ScaledUp" and "from 1 to 4 replicas" in e[2] for e in api.events)
    assert status["sizing"]["measured"]["kvTokens"] == 823472


def test_scale_down_waits_for_the_window_stored_in_status():
    api = FakeApi()
    autoscaled(api, scaleDownStabilizationSeconds=300)
    make_pods(api, 1)
    run(api, autoscale=True, now=1000, scrape=readings({"chat-0": 35}))
    deployment_ready(api)
    make_pods(api, 4)
    quiet = readings({f"chat-{i}": 0 for i in range(4)})
    run(api, autoscale=True, now=1100, scrape=quiet)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 4
    # 4 was the recommendation from 1000 until 1 replaced it at 1100: down at 1100 + 300
    run(api, autoscale=True, now=1399, scrape=quiet)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 4
    run(api, autoscale=True, now=1401, scrape=quiet)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1


def test_missing_metrics_hold_and_say_so():
    api = FakeApi()
    autoscaled(api)
    make_pods(api, 1)
    status = run(api, autoscale=True, scrape=lambda pods, timeout: {})
    sa = cond(status, "ScalingActive")
    assert (sa["status"], sa["reason"]) == ("False", "MetricsMissing")
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1
    assert any(e[0] == "Warning" and e[1] == "MetricsMissing" for e in api.events)


def test_prometheus_down_holds():
    api = FakeApi()
    autoscaled(api, metrics={"source": "prometheus", "url": "http://prom:9090"})
    make_pods(api, 1)

    def broken(*a, **k):
        raise RuntimeError("connection refused")

    status = run(api, autoscale=True, query_prometheus=broken)
    sa = cond(status, "ScalingActive")
    assert (sa["status"], sa["reason"]) == ("False", "MetricsUnavailable") and "http://prom:9090" in sa["message"]


def _broken(*a, **k):
    raise RuntimeError("connection refused")


def test_a_failed_scrape_of_a_fixed_size_service_is_no_error():
    # Review finding (issue 14): the error path formatted spec.scaling.prometheus_url, and spec.scaling
    # is None for a fixed size, so every tick of such a service raised AttributeError.
    api = FakeApi()
    add_isvc(api, smol(replicas=2))
    run(api)
    deployment_ready(api)
    make_pods(api, 2)
    status = run(api, autoscale=True, scrape=_broken)
    assert cond(status, "ScalingActive")["reason"] == "FixedReplicas"
    assert cond(status, "Ready")["status"] == "True"
    assert "measured" not in status["sizing"]


def test_a_failed_scrape_of_an_autoscaled_service_holds_and_names_the_pods():
    api = FakeApi()
    autoscaled(api)
    make_pods(api, 1)
    status = run(api, autoscale=True, scrape=_broken)
    sa = cond(status, "ScalingActive")
    assert (sa["status"], sa["reason"]) == ("False", "MetricsUnavailable")
    assert "pods' /metrics" in sa["message"] and "Prometheus" not in sa["message"]


def test_autoscaling_respects_the_quota():
    api = FakeApi()
    api.quotas = [gpu_quota(hard=2, used=1)]
    autoscaled(api)
    make_pods(api, 1)
    status = run(api, autoscale=True, scrape=readings({"chat-0": 100}))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2  # wanted 4: quota 2 - 1 + our 1
    assert cond(status, "QuotaLimited")["status"] == "True"
    assert status["scaling"]["recommendations"][-1]["replicas"] == 4  # the recommendation before the cap


@pytest.mark.parametrize("spec", [
    {"model": "oops"}, {"model": {"uri": 5}, "resources": []}, {"replicas": "two", **smol()}, None,
])
def test_garbage_objects_become_invalid_spec_not_crashes(spec):
    api = FakeApi()
    body = add_isvc(api, spec)
    if spec is None:
        body.pop("spec")
    status = run(api)
    assert cond(status, "Stalled")["reason"] == "InvalidSpec"
    assert [k[0] for k in api.objects] == ["InferenceService"]


def test_status_patch_keeps_kopf_fields_and_only_sends_changes():
    old = {"observedGeneration": 1, "kopf": {"x": 1}, "sizing": {"a": 1, "b": 2}}
    new = {"observedGeneration": 2, "sizing": {"a": 1, "c": 3}}
    assert merge_patch({k: v for k, v in old.items() if k != "kopf"}, new) == {
        "observedGeneration": 2, "sizing": {"b": None, "c": 3}}


def test_pdb_removed_when_scaled_back_to_one():
    api = FakeApi()
    add_isvc(api, smol(replicas=3))
    run(api)
    assert ("PodDisruptionBudget", NS, "chat") in api.objects
    body = api.objects[("InferenceService", NS, "chat")]
    body["spec"]["replicas"] = 1
    body["metadata"]["generation"] = 2
    run(api)
    assert ("PodDisruptionBudget", NS, "chat") not in api.objects


def test_a_stale_body_is_re_read_so_events_are_not_repeated():
    api = FakeApi()
    stale = copy.deepcopy(add_isvc(api, smol(replicas=2)))
    rec.reconcile(api, stale, rec.OperatorConfig(), autoscale=False, now=1.0)
    n = len(api.events)
    rec.reconcile(api, stale, rec.OperatorConfig(), autoscale=False, now=2.0)  # e.g. a queued watch event
    assert len(api.events) == n
    assert [e[1] for e in api.events].count("Fits") == 1


def test_a_deleted_object_is_left_alone():
    api = FakeApi()
    body = copy.deepcopy(add_isvc(api, smol()))
    api.objects.clear()
    assert rec.reconcile(api, body, rec.OperatorConfig(), autoscale=True) == {}
    assert api.writes == []


def test_gpus_per_replica_agree_in_pod_spec_quota_and_status():
    api = FakeApi()
    api.quotas = [gpu_quota(hard=5, used=0)]
    add_isvc(api, {"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
                   "resources": {"gpu": {"type": "nvidia-h100-80gb"}}, "replicas": 4})
    status = run(api)
    limits = api.objects[("Deployment", NS, "chat")]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "2" == str(status["sizing"]["gpusPerReplica"])
    assert "admits 2 replicas x 2 GPUs" in cond(status, "QuotaLimited")["message"]  # 5 // 2
    assert status["desiredReplicas"] == 2
