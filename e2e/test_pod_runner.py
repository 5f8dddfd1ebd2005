"""Pods that run their real command: every argument the operator writes is executed by `tokenmill serve`.

The InferenceServices here carry the pod-runner label in spec.template.labels (the operator copies it
onto the pods); e2e/pod_runner.py then runs each pod's containers as local processes and the pods'
readiness follows the engines' real probes. The unit tests at the top need no cluster.
"""

from __future__ import annotations

import copy
import ipaddress
from pathlib import Path

import httpx
import openai
from cluster import Cluster
from e2e_helpers import (
    ISVC,
    OperatorProcess,
    apply,
    condition,
    get,
    items,
    ready_for_current_generation,
    wait_for,
)
from gitops_tools import kstatus
from pod_runner import (
    KV_CACHE_CAP_BYTES,
    RUNNER_LABEL,
    PodRunner,
    PodWorker,
    apply_deviations,
    expand,
    rewrite_path,
)
from test_examples import example

ENGINE_START_S = 420  # model load on a busy shared 2-core machine (seen: 20-90 s)


# ---------------------------------------------------------------- unit tests of the kubelet rules


def test_expand_follows_the_kubelet_rules() -> None:
    env = {"A": "1", "B": "x y"}
    assert expand("$(A)-$(B)", env) == "1-x y"
    assert expand("$(MISSING) stays", env) == "$(MISSING) stays"
    assert expand("$$(A) is escaped, $$ alone too", env) == "$(A) is escaped, $ alone too"
    assert expand("$(unclosed", env) == "$(unclosed"


def test_paths_under_a_mount_are_rewritten_and_nothing_else() -> None:
    mounts = {"/cache": Path("/w/p/cache"), "/models/claim": Path("/w/claims/claim")}
    assert rewrite_path("/cache", mounts) == "/w/p/cache"
    assert rewrite_path("/cache/huggingface", mounts) == "/w/p/cache/huggingface"
    assert rewrite_path("--download-dir=/cache/x", mounts) == "--download-dir=/w/p/cache/x"
    assert rewrite_path("/models/claim/llama", mounts) == "/w/claims/claim/llama"
    assert rewrite_path("/cachedir", mounts) == "/cachedir"  # a prefix of a name is not a mount
    assert rewrite_path("/a:/cache/b", mounts) == "/a:/w/p/cache/b"
    assert rewrite_path("bundled://smollm2", mounts) == "bundled://smollm2"


def test_deviations_touch_only_the_bind_address_and_the_kv_pool() -> None:
    argv = ["tokenmill", "serve", "--host", "0.0.0.0", "--port", "8000", "--kv-cache-memory", str(20 * 2**30),
            "--max-model-len", "8192"]
    out = apply_deviations(argv, "127.244.0.7")
    assert out == ["tokenmill", "serve", "--host", "127.244.0.7", "--port", "8000", "--kv-cache-memory",
                   str(256 * 2**20), "--max-model-len", "8192"]
    small = ["x", "--kv-cache-memory=1000", "--host=127.0.0.1"]
    assert apply_deviations(small, "127.244.0.7") == small


class _FakeApi:
    """Stands in for the API server in the unit test only (the e2e tests below use the real one)."""

    def __init__(self, objects: dict[tuple[str, str], dict[str, str]], pods: dict[tuple[str, str], str] | None = None):
        self.objects, self.pods = objects, pods or {}

    def data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        return self.objects.get((kind, name))

    def pod_ip(self, namespace: str, hostname: str, subdomain: str) -> str | None:
        return self.pods.get((hostname, subdomain))


def _pod(container: dict) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "a"}},
            "spec": {"containers": [container], "nodeName": "n1",
                     "volumes": [{"name": "cache", "emptyDir": {}}]},
            "status": {"podIP": "127.244.0.9", "hostIP": "127.0.0.1"}}


def test_environment_is_resolved_like_the_kubelet(tmp_path: Path) -> None:
    c = {"name": "engine", "command": ["tokenmill", "serve"], "args": ["--name", "$(POD)", "--dir", "$(HOME)/x"],
         "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}, {"secretRef": {"name": "s"}}],
         "env": [{"name": "HOME", "value": "/cache"},
                 {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                 {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "level"}}},
                 {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                 {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                 {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
                 {"name": "BOTH", "value": "$(LEVEL)-$(APP)"}],
         "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}
    api = _FakeApi({("Secret", "s"): {"token": "t0k", "EXTRA": "e"}, ("ConfigMap", "cm"): {"level": "debug"}})
    w = PodWorker(api, _pod(c), tmp_path / "pod", tmp_path / "claims")  # type: ignore[arg-type]
    w._prepare_volumes()
    run = w.containers[0]
    w.resolve(run)
    cache = tmp_path / "pod" / "volumes" / "cache"
    assert run.env["TOKEN"] == "t0k" and run.env["EXTRA"] == "e" and run.env["CM_level"] == "debug"
    assert run.env["LEVEL"] == "debug" and run.env["POD"] == "p" and run.env["APP"] == "a"
    assert run.env["BOTH"] == "debug-a" and "GONE" not in run.env
    assert run.env["HOME"] == str(cache)
    assert run.argv[1:] == ["serve", "--name", "p", "--dir", f"{cache}/x"]
    assert Path(run.argv[0]).name == "tokenmill"

    missing = dict(c, env=[{"name": "K", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}], envFrom=[])
    w2 = PodWorker(api, _pod(missing), tmp_path / "pod2", tmp_path / "claims")  # type: ignore[arg-type]
    w2._start(w2.containers[0])
    assert w2.containers[0].state == {"waiting": {"reason": "CreateContainerConfigError",
                                                  "message": 'secret "absent" not found'}}


def test_container_spec_is_the_pod_spec_and_only_the_local_process_deviates(tmp_path: Path) -> None:
    c = {"name": "engine", "command": ["tokenmill", "serve"], "args": ["--host", "0.0.0.0", "--dir", "/cache/x"],
         "env": [{"name": "HOME", "value": "/cache"}, {"name": "LWS_LEADER_ADDRESS", "value": "big-lws-0.big-lws.ns"},
                 {"name": "NOT_A_POD", "value": "a.b.other-namespace"}, {"name": "VERSION", "value": "1.2"}],
         "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}
    pod = _pod(c)
    api = _FakeApi({}, pods={("big-lws-0", "big-lws"): "127.244.0.3"})
    w = PodWorker(api, pod, tmp_path / "pod", tmp_path / "claims")  # type: ignore[arg-type]
    w._prepare_volumes()
    pc = w.container_spec(c)
    # What another runtime gets: the spec's own argv, env and mount paths, nothing rewritten.
    assert pc.argv == ["tokenmill", "serve", "--host", "0.0.0.0", "--dir", "/cache/x"]
    assert pc.env["HOME"] == "/cache" and pc.env["LWS_LEADER_ADDRESS"] == "big-lws-0.big-lws.ns"
    assert pc.mounts == {"/cache": tmp_path / "pod" / "volumes" / "cache"} and pc.pod_ip == "127.244.0.9"
    run = w.containers[0]
    w.resolve(run)
    assert run.argv[1:] == ["serve", "--host", "127.244.0.9", "--dir", f"{tmp_path}/pod/volumes/cache/x"]
    assert run.env["LWS_LEADER_ADDRESS"] == "127.244.0.3"  # what the cluster DNS would answer
    assert run.env["NOT_A_POD"] == "a.b.other-namespace" and run.env["VERSION"] == "1.2"

    # A leader without an IP yet: the container waits (CreateContainerConfigError, retried), as for a Secret.
    w2 = PodWorker(_FakeApi({}), _pod(c), tmp_path / "pod2", tmp_path / "claims")  # type: ignore[arg-type]
    w2._prepare_volumes()
    w2._start(w2.containers[0])
    state = w2.containers[0].state["waiting"]
    assert state["reason"] == "CreateContainerConfigError" and "big-lws-0.big-lws.ns does not resolve" in state["message"]


def test_pods_sharing_a_claim_share_its_folder(tmp_path: Path) -> None:
    def pod(uid: str) -> dict:
        p = _pod({"name": "engine", "command": ["true"]})
        p["metadata"]["uid"] = uid
        p["spec"]["volumes"] = [{"name": "m", "persistentVolumeClaim": {"claimName": "models"}}]
        return p

    a = PodWorker(_FakeApi({}), pod("a"), tmp_path / "a", tmp_path / "claims")  # type: ignore[arg-type]
    b = PodWorker(_FakeApi({}), pod("b"), tmp_path / "b", tmp_path / "claims")  # type: ignore[arg-type]
    a._prepare_volumes()
    b._prepare_volumes()
    (a.volumes["m"] / "weights").write_text("w")
    assert (b.volumes["m"] / "weights").read_text() == "w"


# ---------------------------------------------------------------- e2e: real engines behind the pods


def with_runner(isvc: dict) -> dict:
    isvc = copy.deepcopy(isvc)
    template = isvc["spec"].setdefault("template", {})
    template.setdefault("labels", {})[RUNNER_LABEL] = "true"
    return isvc


def runner_pods(cluster: Cluster, namespace: str, name: str) -> list[dict]:
    pods = items(cluster, "pods", namespace, f"serving.tokenmill.dev/inferenceservice={name}")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def wait_ready_sampling_kstatus(cluster: Cluster, namespace: str, name: str, generation: int = 1) -> tuple[dict, list]:
    """Wait for Ready for `generation`, judging the live object with kstatus at every poll."""
    seen: list[tuple[int | None, int, str]] = []  # (observedGeneration, generation, kstatus)

    def check() -> dict | None:
        o = get(cluster, ISVC, name, namespace)
        if o is None:
            return None
        seen.append(((o.get("status") or {}).get("observedGeneration"), o["metadata"]["generation"],
                     kstatus([o])[0]["status"]))
        return o if o["metadata"]["generation"] == generation and ready_for_current_generation(o) \
            and o["status"].get("readyReplicas") == o["status"].get("desiredReplicas") else None

    return wait_for(check, f"Ready=True for generation {generation} with real engines", timeout=ENGINE_START_S,
                    interval=1.0), seen


def proc_argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")


def completion(pod: dict, headers: dict | None = None) -> httpx.Response:
    """A completion from the engine behind the pod, for the model name the operator gave it. The first
    forward may build the C++ CPU kernels (kernels/cpu.py; minutes on a busy 2-core machine when another
    checkout's build replaced the shared cache), hence the long timeout."""
    args = pod["spec"]["containers"][0]["args"]
    model = args[args.index("--served-model-name") + 1]
    url = f"http://{pod['status']['podIP']}:8000/v1/completions"
    return httpx.post(url, json={"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                                 "temperature": 0}, headers=headers or {}, timeout=600)


def openai_completion(pod: dict):
    """The same request as completion(), through the official openai client."""
    args = pod["spec"]["containers"][0]["args"]
    client = openai.OpenAI(base_url=f"http://{pod['status']['podIP']}:8000/v1", api_key="unused", max_retries=0,
                           timeout=600)
    return client.completions.create(model=args[args.index("--served-model-name") + 1],
                                     prompt="The capital of France is", max_tokens=8, temperature=0)


def assert_runs_deployment_argv(cluster: Cluster, runner: PodRunner, namespace: str, name: str,
                                pod: dict) -> None:
    """The process behind the pod is the Deployment's own command + args (see assert_runs_container_argv)."""
    c = get(cluster, "deployment", name, namespace)["spec"]["template"]["spec"]["containers"][0]
    assert_runs_container_argv(c, runner, pod)


def assert_runs_container_argv(c: dict, runner: PodRunner, pod: dict) -> None:
    """The process behind the pod is the template container `c`'s own command + args, except the two
    documented deviations (bind address, KV pool cap), each checked on its own."""
    worker = runner.worker(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert worker is not None, f"the runner runs no process for pod {pod['metadata']['name']}"
    run = next(r for r in worker.containers if r.name == c["name"])
    assert run.pid is not None, run.state
    argv = proc_argv(run.pid)
    # A console script: the kernel runs the venv's python on .venv/bin/tokenmill.
    assert Path(argv[1]).name == c["command"][0] and Path(argv[1]).parent.name == "bin", argv
    wanted = [*c["command"][1:], *c["args"]]
    got = argv[2:]
    assert len(got) == len(wanted), (got, wanted)
    diffs = {i for i, (a, b) in enumerate(zip(got, wanted, strict=True)) if a != b}
    host, kv = wanted.index("--host") + 1, wanted.index("--kv-cache-memory") + 1
    assert diffs <= {host, kv}, [(wanted[i], got[i]) for i in sorted(diffs)]
    assert wanted[host] == "0.0.0.0" and got[host] == pod["status"]["podIP"]
    assert int(got[kv]) == min(int(wanted[kv]), KV_CACHE_CAP_BYTES)
    assert ipaddress.ip_address(pod["status"]["podIP"]).is_loopback


def test_bundled_example_runs_the_deployment_argv_and_answers(
        cluster: Cluster, operator: OperatorProcess, pod_runner: PodRunner, namespace: str) -> None:
    isvc = with_runner(next(d for d in example("bundled-one-gpu.yaml", namespace) if d["kind"] == "InferenceService"))
    name = isvc["metadata"]["name"]
    apply(cluster, isvc)
    _, seen = wait_ready_sampling_kstatus(cluster, namespace, name)
    [pod] = runner_pods(cluster, namespace, name)
    assert_runs_deployment_argv(cluster, pod_runner, namespace, name, pod)

    # Readiness came from the real probe: the engine's /health failed before it passed (model load).
    run = pod_runner.worker(namespace, pod["metadata"]["name"]).containers[0]
    assert ("startup", False) in run.probe_log and ("readiness", True) in run.probe_log, run.probe_log
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and status["started"] and "running" in status["state"], status
    assert condition(pod, "Ready")["lastTransitionTime"] >= status["state"]["running"]["startedAt"]

    # kstatus (Flux, kpt) saw it reconciling for the current generation, then Current.
    assert any(s == "InProgress" and og == g for og, g, s in seen), seen
    assert seen[-1][2] == "Current", seen

    rsp = completion(pod)
    assert rsp.status_code == 200, rsp.text
    body = rsp.json()
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] >= 1, body
    assert pod_runner.all_errors() == []


def test_other_runnable_examples_reach_ready_on_real_probes(
        cluster: Cluster, operator: OperatorProcess, pod_runner: PodRunner, namespaces) -> None:
    """autoscaled.yaml and quota-limited-namespace.yaml with real engines (both at once: 3 engines).
    bundled-one-gpu.yaml is the test above, bundled-tensor-parallel.yaml the last one here,
    hub-model-cached.yaml is in test_pod_runner_hub.py, and infeasible-model.yaml has no pod to run
    (test_examples.py: Stalled before any pod)."""
    where = {}
    for file, tag in (("autoscaled.yaml", "auto"), ("quota-limited-namespace.yaml", "quota")):
        ns = namespaces(tag)
        docs = [with_runner(d) if d["kind"] == "InferenceService" else d for d in example(file, ns)]
        for d in docs:
            apply(cluster, d, ns)
        where[file] = (ns, next(d for d in docs if d["kind"] == "InferenceService")["metadata"]["name"])

    status = {}
    for file, (ns, name) in where.items():
        obj, seen = wait_ready_sampling_kstatus(cluster, ns, name)
        assert seen[-1][2] == "Current", (file, seen)
        pods = runner_pods(cluster, ns, name)
        assert len(pods) == obj["status"]["desiredReplicas"] == obj["status"]["readyReplicas"], (file, obj["status"])
        for pod in pods:
            assert_runs_deployment_argv(cluster, pod_runner, ns, name, pod)
            run = pod_runner.worker(ns, pod["metadata"]["name"]).containers[0]
            assert ("startup", False) in run.probe_log and ("readiness", True) in run.probe_log, (file, run.probe_log)
            rsp = completion(pod)
            assert rsp.status_code == 200, (file, rsp.text)
        status[file] = obj

    quota = status["quota-limited-namespace.yaml"]
    assert quota["status"]["desiredReplicas"] == 2 and condition(quota, "QuotaLimited")["status"] == "True"
    # With real engines behind the pods the autoscaler reads their metrics (with kwok's empty pods it
    # holds with ScalingActive=False, test_examples.py).
    ns, name = where["autoscaled.yaml"]
    wait_for(lambda: (c := condition(get(cluster, ISVC, name, ns), "ScalingActive")) and c["status"] == "True" and c,
             "ScalingActive=True from the engines' metrics", timeout=60)
    assert pod_runner.all_errors() == []


def rank_processes(root: int) -> dict[int, list[str]]:
    """The engine's local worker ranks (processes under `root` running tokenmill.engine.worker.rank_main;
    the engine core process, a child of the API server, starts them), by their --rank."""
    parents, argvs = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argvs[int(entry.name)] = proc_argv(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue

    def under_root(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return {int(argv[argv.index("--rank") + 1]): argv for pid, argv in argvs.items()
            if "tokenmill.engine.worker.rank_main" in argv and under_root(pid)}


def test_tensor_parallel_example_runs_three_ranks_and_answers(
        cluster: Cluster, operator: OperatorProcess, pod_runner: PodRunner, namespace: str) -> None:
    """examples/bundled-tensor-parallel.yaml (gpu.count 3): the plan is TP 3 on one pod, the pod runs the
    Deployment's `tokenmill serve --tensor-parallel-size 3`, whose engine core starts two more ranks (3 CPU processes,
    gloo; deviation 1), and the official openai client gets a completion from it."""
    [isvc] = [with_runner(d) for d in example("bundled-tensor-parallel.yaml", namespace)]
    name = isvc["metadata"]["name"]
    apply(cluster, isvc)
    obj, seen = wait_ready_sampling_kstatus(cluster, namespace, name)
    assert seen[-1][2] == "Current", seen
    sizing = obj["status"]["sizing"]
    assert (sizing["tensorParallelSize"], sizing["pipelineParallelSize"], sizing["nodesPerReplica"],
            sizing["gpusPerReplica"]) == (3, 1, 1, 3), sizing
    # 1 of the 3 KV heads per rank: K and V x 30 layers x 1 head x 64 x 2 bytes (bfloat16).
    assert sizing["kvBytesPerToken"] == 2 * 30 * 1 * 64 * 2

    [pod] = runner_pods(cluster, namespace, name)
    assert pod["spec"]["nodeName"] == "gpu-l4-0"  # the one node with L4s (4 GPUs)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "3"
    assert_runs_deployment_argv(cluster, pod_runner, namespace, name, pod)
    run = pod_runner.worker(namespace, pod["metadata"]["name"]).containers[0]
    argv = proc_argv(run.pid)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "3", argv
    ranks = rank_processes(run.pid)
    assert sorted(ranks) == [1, 2], ranks
    for rank_argv in ranks.values():
        assert rank_argv[rank_argv.index("--tensor-parallel-size") + 1] == "3"
        assert rank_argv[rank_argv.index("--device") + 1] == "cpu"

    rsp = openai_completion(pod)
    assert rsp.choices[0].text and rsp.usage.completion_tokens >= 1, rsp
    assert set(rank_processes(run.pid)) == {1, 2}  # the ranks served it and are still up
    assert pod_runner.all_errors() == []
