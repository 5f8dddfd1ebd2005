"""Multi-node replicas: sizing across nodes (TP inside a node, PP across), the LeaderWorkerSet built from a
plan, and reconcile running it (against the dict-backed fake; the real LWS controller is e2e/test_multinode.py).

The expected numbers are worked out by hand in the comments from the documented model (docs/operator.md,
"Sizing" and "Multi-node"), not read back from the code."""

from tokenmill.operator.children import leaderworkerset as lws
from tokenmill.operator.plan.catalog import GPU_TYPES, MODEL_PROFILES
from tokenmill.operator.plan.observations import PodReading
from tokenmill.operator.plan.sizing import gpus_per_pod, gpus_per_replica, plan
from tokenmill.operator.plan.spec import parse_inference_service
from tokenmill.operator.status import plan_status

from tests.test_operator_reconcile import NS, add_isvc, cond, gpu_quota, run
from tests.test_operator_reconcile import FakeApi as SingleNodeFakeApi


class FakeApi(SingleNodeFakeApi):
    """With API discovery: whether the LeaderWorkerSet CRD is served."""

    def __init__(self, lws_installed: bool = True):
        super().__init__()
        self.lws_installed = lws_installed

    def has_resource(self, group, version, plural):
        assert (group, version, plural) == ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
        return self.lws_installed

BIG = "Llama-3.1-405B"


def test_405b_on_h100_nodes_is_two_nodes_of_eight_by_hand():
    # One node: 405,853,388,800 x 2 bytes / 8 = 101.5 GB per GPU > 81,559 MiB: no single-node TP fits.
    # Two stages of ceil(126 / 2) = 63 layers. Per layer (405,853,388,800 - 2 x 128,256 x 16,384 - 16,384) / 126
    # = 3,187,703,808; the largest stage holds 63 of them + one 128,256 x 16,384 vocabulary matrix + the norm:
    # 202,926,702,592 parameters, x 2 bytes / TP 8 = 50,731,675,648 bytes per GPU.
    # KV per token per GPU: 2 x 63 layers x 1 KV head (8 / 8) x 128 x 2 = 32,256 bytes.
    # Activations 3.5 x 2048 x 2 x (2 x 16384 + (16 + 2) x 128 + 3 x 6656) = 789,053,440; sampler
    # 256 x 128,256 x 20 = 656,670,720; overhead 2 GiB + 0.5 GiB + both = 4,130,078,720.
    # Usable floor(0.9 x 81,559 MiB) = 76,968,728,985; budget 22,106,974,617 -> 42,835 blocks of 516,096 bytes.
    p = plan(MODEL_PROFILES[BIG], GPU_TYPES["nvidia-h100-80gb"])
    assert p.feasible and p.reason == "Fits"
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.nodes_per_replica) == (8, 2, 2)
    assert gpus_per_replica(p) == 16 and gpus_per_pod(p) == 8
    assert p.weights_bytes_per_gpu == 50_731_675_648
    assert p.kv_bytes_per_token == 32_256
    assert p.overhead_bytes == 4_130_078_720
    assert (p.kv_blocks, p.kv_tokens) == (42_835, 685_360)
    assert p.max_model_len == 131_072  # the model's limit
    assert p.max_num_seqs == 256  # 42,835 // 128 blocks of 2048 tokens = 334, capped
    assert p.message.startswith("2 nodes x 8 x nvidia-h100-80gb (TP 8 x PP 2) per replica")


def test_405b_on_a100_40gb_needs_three_nodes_by_hand():
    # PP 2 leaves nothing: 50,731,675,648 + 4,130,078,720 > floor(0.9 x 40,960 MiB) = 38,654,705,664.
    # PP 3: 42 layers per stage: (3,187,703,808 x 42 + 2,101,362,688) x 2 / 8 = 33,996,230,656 per GPU;
    # budget 38,654,705,664 - 33,996,230,656 - 4,130,078,720 = 528,396,288; KV 2 x 42 x 128 x 2 = 21,504 B/token
    # -> 1,535 blocks of 344,064 bytes = 24,560 tokens (>= 4096, so feasible); maxNumSeqs 1,535 // 128 = 11.
    p = plan(MODEL_PROFILES[BIG], GPU_TYPES["nvidia-a100-40gb"])
    assert p.feasible
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, gpus_per_replica(p)) == (8, 3, 24)
    assert p.weights_bytes_per_gpu == 33_996_230_656 and p.kv_bytes_per_token == 21_504
    assert (p.kv_blocks, p.max_model_len, p.max_num_seqs) == (1_535, 24_560, 11)


def test_405b_on_l4_does_not_fit_four_nodes_and_names_what_does():
    # 4 nodes x 8 x 24 GB = 772 GB < 812 GB of weights. Least total memory that fits elsewhere:
    # 3 x 8 x A100-40GB = 983,040 MiB < 8 x H200 (1,150,168) < 16 x H100 (1,304,944) < 16 x A100-80GB.
    p = plan(MODEL_PROFILES[BIG], GPU_TYPES["nvidia-l4"])
    assert not p.feasible and p.reason == "WeightsDoNotFit"
    assert p.pipeline_parallel_size == 4  # the largest layout tried
    assert p.message.endswith("use gpu.type nvidia-a100-40gb without a count (3 nodes x 8 GPUs per replica)")


def test_models_that_fit_one_node_stay_on_one_node():
    for model in ("Llama-3.1-8B", "Llama-3.1-70B", "Qwen2.5-72B"):
        p = plan(MODEL_PROFILES[model], GPU_TYPES["nvidia-h100-80gb"])
        assert p.feasible and p.nodes_per_replica == 1 and p.pipeline_parallel_size == 1
        assert gpus_per_pod(p) == gpus_per_replica(p) == p.tensor_parallel_size
    # An explicit gpu.count is one node: the 405B model does not fit 8 H100s, and no PP is tried.
    p = plan(MODEL_PROFILES[BIG], GPU_TYPES["nvidia-h100-80gb"], gpu_count=8)
    assert not p.feasible and p.nodes_per_replica == 1
    assert "no gpu.count (2 nodes x 8 GPUs per replica)" in p.message


def test_status_reports_the_layout():
    p = plan(MODEL_PROFILES[BIG], GPU_TYPES["nvidia-h100-80gb"])
    s = plan_status(p, MODEL_PROFILES[BIG])
    assert (s["gpusPerReplica"], s["nodesPerReplica"], s["tensorParallelSize"], s["pipelineParallelSize"]) == (
        16, 2, 8, 2)


# ---------------------------------------------------------------- the LeaderWorkerSet

def _isvc(spec: dict) -> dict:
    return {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "big", "namespace": NS, "uid": "uid-big", "generation": 1}, "spec": spec}


BIG_SPEC = {"model": {"uri": "hf://meta-llama/Llama-3.1-405B-Instruct"},
            "resources": {"gpu": {"type": "nvidia-h100-80gb"}}, "replicas": 3}


def _engine(template: dict) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == "engine")


def test_leaderworkerset_groups_leader_and_workers():
    spec = parse_inference_service(_isvc(BIG_SPEC))
    p = plan(MODEL_PROFILES[BIG], GPU_TYPES["nvidia-h100-80gb"])
    obj = lws.desired_leaderworkerset(spec, p, 3, "img:1")
    assert (obj["apiVersion"], obj["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert obj["metadata"]["name"] == "big-lws" and obj["metadata"]["ownerReferences"][0]["uid"] == "uid-big"
    assert obj["spec"]["replicas"] == 3 and obj["spec"]["startupPolicy"] == "LeaderCreated"
    t = obj["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _engine(t["leaderTemplate"]), _engine(t["workerTemplate"])
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8" == c["resources"]["requests"]["nvidia.com/gpu"]
        assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "8"
        assert c["args"][c["args"].index("--pipeline-parallel-size") + 1] == "2"
        assert c["image"] == "img:1" and c["command"] == ["tokenmill", "serve"]
    assert worker["args"] == [*leader["args"], "--headless"]
    # Only the leader serves HTTP: port, probes and the metrics annotations are the leader's alone.
    assert leader["ports"][0]["containerPort"] == 8000 and "readinessProbe" in leader
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    assert "prometheus.io/scrape" in t["leaderTemplate"]["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in t["workerTemplate"]["metadata"]["annotations"]
    roles = [x["metadata"]["labels"][lws.ROLE_LABEL] for x in (t["leaderTemplate"], t["workerTemplate"])]
    assert roles == ["leader", "worker"]
    # Same volumes and scheduling constraints on every pod of the group.
    assert t["leaderTemplate"]["spec"]["volumes"] == t["workerTemplate"]["spec"]["volumes"]
    assert t["leaderTemplate"]["spec"]["affinity"] == t["workerTemplate"]["spec"]["affinity"]


def test_engine_accepts_the_group_arguments():
    """The contract with the engine, executed: the real server parser takes the leader's and worker's argv."""
    from tokenmill.engine.cli.serve import build_parser

    parser = build_parser()
    spec = parse_inference_service(_isvc(BIG_SPEC))
    t = lws.desired_leaderworkerset(spec, plan(MODEL_PROFILES[BIG], GPU_TYPES["nvidia-h100-80gb"]), 1, "i")
    leader = parser.parse_args(_engine(t["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["args"])
    worker = parser.parse_args(_engine(t["spec"]["leaderWorkerTemplate"]["workerTemplate"])["args"])
    assert (leader.tensor_parallel_size, leader.pipeline_parallel_size) == (8, 2)
    assert worker.headless and not leader.headless


def test_rollout_source_reads_groups():
    obj = {"metadata": {"name": "big-lws", "generation": 4}, "spec": {"replicas": 2},
           "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                      "conditions": [{"type": "UpdateInProgress", "status": "True"}]}}
    view = lws.rollout_source(obj)
    assert view["status"] == {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2, "observedGeneration": 3}
    obj["status"]["conditions"][0]["status"] = "False"
    assert lws.rollout_source(obj)["status"]["observedGeneration"] == 4
    assert lws.rollout_source(None) is None


# ---------------------------------------------------------------- reconcile

def _group_pods(api: FakeApi, groups: int, ready: bool = True) -> None:
    api.pods = [{
        "metadata": {"name": f"big-lws-{g}" + (f"-{w}" if w else ""),
                     "labels": {lws.ROLE_LABEL: "worker" if w else "leader"}},
        "spec": {"containers": [{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
        "status": {"phase": "Running", "podIP": f"127.244.0.{2 * g + w}",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    } for g in range(groups) for w in (0, 1)]


def test_reconcile_runs_a_multi_node_service_as_a_leaderworkerset():
    api = FakeApi()
    # 40 GPUs of quota, 16 per group (2 pods x 8): 2 of the 3 groups fit. One group already runs, and
    # its two pods' 16 GPUs count as this service's own.
    api.quotas = [gpu_quota(hard=40, used=16)]
    _group_pods(api, 1)
    add_isvc(api, BIG_SPEC, name="big")
    status = run(api, name="big")
    assert ("Deployment", NS, "big") not in api.objects
    obj = api.objects[("LeaderWorkerSet", NS, "big-lws")]
    assert obj["spec"]["replicas"] == 2 and status["desiredReplicas"] == 2
    assert "admits 2 replicas x 16 GPUs" in cond(status, "QuotaLimited")["message"]
    assert api.objects[("Service", NS, "big")]["spec"]["selector"][lws.ROLE_LABEL] == "leader"
    assert status["selector"].endswith(f",{lws.ROLE_LABEL}=leader")
    assert status["sizing"]["nodesPerReplica"] == 2

    # Group readiness: the LWS counts groups whose every pod is ready.
    obj["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    status = run(api, name="big")
    assert (status["replicas"], status["readyReplicas"]) == (2, 1)
    assert cond(status, "Ready")["status"] == "False"
    obj["status"]["readyReplicas"] = 2
    status = run(api, name="big")
    assert cond(status, "Ready")["status"] == "True"


def test_plan_moving_between_one_node_and_several_replaces_the_workload():
    api = FakeApi()
    add_isvc(api, BIG_SPEC, name="big")
    run(api, name="big")
    assert ("LeaderWorkerSet", NS, "big-lws") in api.objects
    # H200s hold the model on one node (101.5 GB per GPU of 141): a Deployment replaces the groups.
    body = api.objects[("InferenceService", NS, "big")]
    body["spec"]["resources"]["gpu"]["type"] = "nvidia-h200-141gb"
    body["metadata"]["generation"] = 2
    status = run(api, name="big")
    assert ("LeaderWorkerSet", NS, "big-lws") not in api.objects and ("Deployment", NS, "big") in api.objects
    assert ("delete", "LeaderWorkerSet", NS, "big-lws") in api.writes
    assert lws.ROLE_LABEL not in api.objects[("Service", NS, "big")]["spec"]["selector"]
    assert status["sizing"]["nodesPerReplica"] == 1
    # And back: the Deployment goes once the LeaderWorkerSet exists.
    body["spec"]["resources"]["gpu"]["type"] = "nvidia-h100-80gb"
    body["metadata"]["generation"] = 3
    run(api, name="big")
    assert ("Deployment", NS, "big") not in api.objects and ("LeaderWorkerSet", NS, "big-lws") in api.objects


def test_single_node_services_never_read_leaderworkersets():
    api = FakeApi()
    add_isvc(api, {"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpu": {"type": "nvidia-l4"}}})
    seen = []
    get = api.get
    api.get = lambda kind, ns, name: seen.append(kind) or get(kind, ns, name)
    run(api)
    assert "LeaderWorkerSet" not in seen  # no LWS CRD or RBAC needed for them


def test_autoscaler_scales_groups_from_the_leaders_queue_depth():
    api = FakeApi()
    spec = {**BIG_SPEC, "scaling": {"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 10}}
    spec.pop("replicas")
    add_isvc(api, spec, name="big")
    run(api, name="big")
    obj = api.objects[("LeaderWorkerSet", NS, "big-lws")]
    assert obj["spec"]["replicas"] == 1
    obj["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    _group_pods(api, 1)
    scraped = []

    def scrape(pods, timeout):
        scraped.append(sorted(p["metadata"]["name"] for p in pods))
        return {p["metadata"]["name"]: PodReading(running=25) for p in pods}

    status = run(api, name="big", autoscale=True, scrape=scrape)
    assert scraped == [["big-lws-0"]]  # the leader; the worker serves no metrics
    # ceil(25 / 10) = 3 groups: the LWS's replicas (its scale subresource's field), not pods
    assert api.objects[("LeaderWorkerSet", NS, "big-lws")]["spec"]["replicas"] == 3
    assert any(e[1] == "ScaledUp" and "LeaderWorkerSet big-lws from 1 to 3 replicas" in e[2] for e in api.events)
    assert status["desiredReplicas"] == 3


def test_without_the_lws_crd_the_service_stalls_with_a_reason():
    api = FakeApi(lws_installed=False)
    add_isvc(api, BIG_SPEC, name="big")
    status = run(api, name="big")
    stalled = cond(status, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "LeaderWorkerSetNotInstalled")
    assert "2 nodes per replica (TP 8 x PP 2 on nvidia-h100-80gb)" in stalled["message"]
    assert "leaderworkersets.leaderworkerset.x-k8s.io/v1" in stalled["message"]
    assert not [w for w in api.writes if w[0] == "apply" and w[1] in ("LeaderWorkerSet", "Deployment")]
    assert cond(status, "Sized")["status"] == "True"  # the plan itself is fine
