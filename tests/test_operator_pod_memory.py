"""The engine pod's memory request covers what its processes hold while the weights load
(engine/load_memory.py, operator/plan/sizing.host_memory_bytes)."""

from tokenmill.engine import load_memory
from tokenmill.operator.children.deployment import desired_deployment
from tokenmill.operator.plan.catalog import GPU_TYPES
from tokenmill.operator.plan.profiles import resolve_profile
from tokenmill.operator.plan.quota import parse_quantity
from tokenmill.operator.plan.sizing import plan
from tokenmill.operator.plan.spec import parse_inference_service


def _build(spec: dict):
    obj = {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "chat", "namespace": "team-a", "uid": "uid-1", "generation": 1}, "spec": spec}  # fmt: skip
    s = parse_inference_service(obj)
    p = plan(resolve_profile(s), GPU_TYPES[s.gpu_type], s.engine, s.gpu_count)
    resources = desired_deployment(s, p, 1, "img:1")["spec"]["template"]["spec"]["containers"][0]["resources"]
    return p, resources


def test_a_small_memory_setting_is_raised_to_the_load_peak() -> None:
    # Llama-3.1-70B on 2 x H100: two rank processes each read the 128256 x 8192 embedding (4.2 GB in fp32)
    # on the host before it goes to their GPU, at the same time.
    p, resources = _build({"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
                           "resources": {"gpu": {"type": "nvidia-h100-80gb"}, "memory": "4Gi"}})  # fmt: skip
    assert p.tensor_parallel_size == 2
    embedding_fp32 = 128256 * 8192 * 4
    requested = int(parse_quantity(resources["requests"]["memory"]))
    assert requested == p.host_memory_bytes == int(parse_quantity(resources["limits"]["memory"]))
    assert requested >= 2 * (embedding_fp32 + load_memory.ENGINE_PROCESS_BYTES) + load_memory.API_SERVER_BYTES
    assert requested > 4 * 2**30


def test_a_memory_setting_that_covers_the_peak_is_kept() -> None:
    p, resources = _build({"model": {"uri": "bundled://smollm2-135m-instruct"},
                           "resources": {"gpu": {"type": "nvidia-l4"}, "memory": "32Gi"}})  # fmt: skip
    assert p.host_memory_bytes < 32 * 2**30
    assert resources["requests"]["memory"] == "32Gi" == resources["limits"]["memory"]
