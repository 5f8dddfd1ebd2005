"""The operator and the engine size an AWQ / GPTQ hub model alike, and refuse the same ones: the operator's
reconcile writes the pod for a quantized hf:// model (config.json from the Hub stand-in), and the real
`tokenmill serve --check` runs that pod's argv and prints the weights' bytes as it will hold them
(engine/quant_memory.py for both). The controls: what the engine refuses (tensor parallelism over int4
weights, act-order GPTQ), the operator refuses too, with a reason, before any pod exists.

The one difference from the pod: the check is told `--device cuda`. The pod's `--device auto` finds its GPU;
this machine has none, and `--check --device cuda` plans for one without probing it.
"""

import json

import pytest
from hub_standin import HubStandin
from test_operator_catalog import LLAMA_31_8B_CONFIG
from test_operator_engine_argv import engine_container, run_check

# The catalog's Llama-3.1-8B count (the Hub's safetensors metadata of the bf16 repo): what an AWQ 8B holds on
# a GPU once the engine dequantizes it to bf16, 2 bytes each.
LLAMA_31_8B_PARAMETERS = 8_030_261_248
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ_ACT_ORDER = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
AWQ_REPO = "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4"
GPTQ_REPO = "example-org/Llama-3.1-8B-Instruct-GPTQ-act-order"
ON_GPU = ["--device", "cuda"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with HubStandin() as hub:
        for repo, quant in ((AWQ_REPO, AWQ), (GPTQ_REPO, GPTQ_ACT_ORDER)):
            folder = tmp_path_factory.mktemp("repo")
            (folder / "config.json").write_text(json.dumps({**LLAMA_31_8B_CONFIG, "quantization_config": quant}))
            hub.add_repo(repo, folder)
        yield hub


def service(repo: str, gpu: dict) -> dict:
    return {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "quantized"},
            "spec": {"model": {"uri": f"hf://{repo}"}, "resources": {"gpu": gpu}}}  # fmt: skip


def test_the_engines_check_counts_the_bytes_the_operator_sized(hub, tmp_path, monkeypatch, capsys):
    status: dict = {}
    container = engine_container(service(AWQ_REPO, {"type": "nvidia-l4"}), hub.url, tmp_path, status)
    sizing = status["sizing"]
    assert container is not None, sizing
    assert sizing["quantization"] == "awq-g128" and sizing["tensorParallelSize"] == 1
    # On a GPU the int4 weights are dequantized at load: bf16 bytes of the weights the shape holds, not of the
    # Hub's count of packed int32 words.
    assert sizing["weightsBytes"] == 2 * LLAMA_31_8B_PARAMETERS
    assert sizing["weightsFrom"].startswith("awq-g128: int4 projections") and "bfloat16" in sizing["weightsFrom"]
    assert "--device" not in container["args"]
    rc, out = run_check(container, tmp_path, monkeypatch, capsys, [*container["args"], *ON_GPU])
    assert rc == 0 and out.startswith(f"ok: hf://{AWQ_REPO}") and "bfloat16 on cuda" in out, out
    assert f"as held ({sizing['weightsBytes']} bytes, 2.000 bytes per weight, awq int4)" in out, out
    assert f"KV pool {sizing['kvBlocks']} blocks x {sizing['blockSize']} tokens" in out, out


def test_tensor_parallelism_over_int4_weights_is_refused_by_both(hub, tmp_path, monkeypatch, capsys):
    status: dict = {}
    assert engine_container(service(AWQ_REPO, {"type": "nvidia-l4", "count": 2}), hub.url, tmp_path, status) is None
    assert status["sizing"]["reason"] == "InvalidGPUCount", status["sizing"]
    assert "without tensor parallelism: use gpu.count 1" in status["sizing"]["message"]
    # The engine refuses the argv the operator would have written.
    container = engine_container(service(AWQ_REPO, {"type": "nvidia-l4"}), hub.url, tmp_path)
    rc, out = run_check(container, tmp_path, monkeypatch, capsys, [*container["args"], *ON_GPU, "--tensor-parallel-size", "2"])
    assert rc == 2 and "awq int4 checkpoints are not supported with tensor parallelism" in out, out


def test_a_quantization_the_engine_cannot_load_is_refused_by_both(hub, tmp_path, monkeypatch, capsys):
    status: dict = {}
    assert engine_container(service(GPTQ_REPO, {"type": "nvidia-l4"}), hub.url, tmp_path, status) is None
    assert status["sizing"]["reason"] == "UnsupportedQuantization", status["sizing"]
    message = "GPTQ with act-order (desc_act: true) is not supported"
    assert message in status["sizing"]["message"]
    sized = {c["type"]: c for c in status["conditions"]}["Sized"]
    assert sized["status"] == "False" and sized["reason"] == "UnsupportedQuantization"
    container = engine_container(service(AWQ_REPO, {"type": "nvidia-l4"}), hub.url, tmp_path)
    args = list(container["args"])
    args[args.index("--model") + 1] = f"hf://{GPTQ_REPO}"
    rc, out = run_check(container, tmp_path, monkeypatch, capsys, [*args, *ON_GPU])
    assert rc == 2 and message in out, out


def test_a_gguf_is_sized_as_the_engine_holds_it_on_a_gpu(hub, tmp_path, monkeypatch, capsys):
    """The bundled model is a Q4_1 GGUF: the operator (no file to read) counts its catalog parameters in the
    dtype; the engine's check reads the file's header and, for a GPU, counts each tensor dequantized."""
    import yaml
    from test_operator_engine_argv import ROOT

    doc = yaml.safe_load((ROOT / "examples" / "bundled-one-gpu.yaml").read_text())
    status: dict = {}
    container = engine_container(doc, hub.url, tmp_path, status)
    sizing = status["sizing"]
    assert sizing["weightsFrom"].startswith("a GGUF file, dequantized to bfloat16"), sizing["weightsFrom"]
    rc, out = run_check(container, tmp_path, monkeypatch, capsys, [*container["args"], *ON_GPU])
    assert rc == 0 and "gguf Q4_1/Q8_0" in out, out
    assert f"as held ({sizing['weightsBytes']} bytes, 2.000 bytes per weight" in out, out
