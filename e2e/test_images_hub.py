"""examples/hub-model-cached.yaml through the pod runner's container mode: both replicas run as podman
containers of the engine image, download from the Hub stand-in (tests/hub_standin.py, the one stand-in)
through the HF_ENDPOINT the operator writes, into the shared cache claim, and answer at their pod IPs.

Networking: the containers share the host's network namespace (container_runner.CONTAINER_DEVIATIONS),
so the stand-in's loopback URL the operator is given (--hf-endpoint=http://127.0.0.1:PORT) is reached from
inside the container as from the host. The session's operator is replaced for this module by one with
--hf-endpoint (as in test_pod_runner_hub.py, the same example in process mode).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import container_runner
import pytest
from cluster import Cluster
from container_runner import podman
from e2e_helpers import OperatorProcess, apply, get, prebound_volume, replaced_operator
from hub_standin import HubStandin
from pod_runner import PodRunner
from test_examples import example
from test_images_pods import (
    assert_container_is_the_pod,
    completion,
    in_podman,
    runner_pods,
    wait_containers_gone,
    wait_ready,
)

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return container_runner.build_images()


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandin]:
    from tokenmill.engine.model.bundled import bundled_gguf_path
    from tokenmill.engine.model.gguf_cache import dequantized_copy_cached

    with HubStandin() as hub:
        hub.smollm2_sha = hub.add_repo(SMOLLM2, dequantized_copy_cached(bundled_gguf_path()))
        yield hub


@pytest.fixture(scope="module")
def hub_operator(cluster: Cluster, operator: OperatorProcess, chart_release: str, hub: HubStandin,
                 tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("op") / "operator.log"
    with replaced_operator(cluster, operator, chart_release, [f"--hf-endpoint={hub.url}"], log) as mine:
        yield mine


def test_hub_example_runs_in_the_engine_image(cluster: Cluster, hub_operator: OperatorProcess,
                                              pod_runner: PodRunner, hub: HubStandin, images: dict[str, str],
                                              namespace: str) -> None:
    isvc = in_podman(next(d for d in example("hub-model-cached.yaml", namespace) if d["kind"] == "InferenceService"))
    name = isvc["metadata"]["name"]
    claim = f"{name}-model-cache"
    # No storage provisioner here: a volume pre-bound to the claim the operator creates; the runner gives
    # the claim one folder, bind-mounted into both containers.
    pv = prebound_volume(cluster, namespace, claim)
    try:
        hub.reset_log()
        apply(cluster, isvc)
        obj = wait_ready(cluster, namespace, name)
        assert obj["status"]["readyReplicas"] == 2, obj["status"]
        assert obj["status"]["sizing"]["hub"]["commit"] == hub.smollm2_sha, obj["status"]["sizing"]
        pods = runner_pods(cluster, namespace, name)
        assert len(pods) == 2
        for pod in pods:
            cname = assert_container_is_the_pod(pod, pod_runner, images["engine"])
            env = dict(e.split("=", 1) for e in json.loads(podman("inspect", cname).stdout)[0]["Config"]["Env"])
            assert env["HF_ENDPOINT"] == hub.url, env  # the operator's --hf-endpoint, unchanged
            rsp = completion(pod)
            assert rsp.status_code == 200, rsp.text
            assert rsp.json()["choices"][0]["text"], rsp.json()
            assert container_runner.written_outside_volumes(cname) == []
        # The containers reached the stand-in on the host's loopback: the weights came over the wire once
        # (the second replica waited on the first one's lock in the shared claim), no file twice.
        gets = [r.filename for r in hub.requests(SMOLLM2, "GET") if r.filename and r.status in (200, 206)]
        assert gets.count(WEIGHTS) == 1, gets
        assert len(gets) == len(set(gets)), gets
        # ...and wrote them into the claim's folder as the pod's UID (the image's read-only root holds nothing).
        claim_dir = pod_runner.root / "claims" / namespace / claim
        weights = [p for p in claim_dir.rglob(WEIGHTS) if p.is_file()]
        assert weights, sorted(str(p) for p in claim_dir.rglob("*"))[:20]
        uid = pods[0]["spec"]["securityContext"]["runAsUser"]
        assert {p.stat().st_uid for p in weights} == {uid}
        assert get(cluster, "pvc", claim, namespace)["status"]["phase"] == "Bound"
        assert pod_runner.all_errors() == []
    finally:
        wait_containers_gone(cluster, namespace, name)
        cluster.kubectl("delete", "pv", pv, "--ignore-not-found")
