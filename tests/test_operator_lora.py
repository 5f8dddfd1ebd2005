"""spec.model.lora through the operator's reconcile, without a cluster: the engine flags (parsed by the
engine's own parser), the ConfigMap the pods follow, the sizing that leaves the adapter slots out of the KV
budget (the engine's own function, checked against what the engine allocates), status.lora from the engines'
own metrics, and an adapter edit that changes the ConfigMap and not the pod template."""

import json

import pytest
import torch
from test_operator_reconcile import NS, FakeApi, add_isvc, deployment_ready, make_pods, run, smol
from tiny_models import make_tiny_model
from tokenmill.engine.cli.serve import parse_args
from tokenmill.engine.lora_memory import lora_slot_bytes
from tokenmill.engine.server.prometheus import ServerMetrics
from tokenmill.operator.observe.engine_metrics import parse_engine_metrics
from tokenmill.operator.plan.catalog import GPU_TYPES, find_model_profile
from tokenmill.operator.plan.sizing import EngineSettings, plan
from tokenmill.operator.plan.spec import SpecError, parse_inference_service

ADAPTERS = [{"name": "sql", "uri": "hf://acme/sql-lora@v1"}, {"name": "support", "uri": "pvc://adapters/support"}]


def lora_service(adapters=ADAPTERS, **lora) -> dict:
    spec = smol()
    spec["model"]["lora"] = {"adapters": adapters, **lora}
    return spec


def engine(api: FakeApi) -> dict:
    return api.objects[("Deployment", NS, "chat")]["spec"]["template"]["spec"]


def test_pods_get_the_engines_lora_flags_and_follow_the_adapters_configmap():
    api = FakeApi()
    add_isvc(api, lora_service(maxRank=32, maxAdapters=2))
    status = run(api)
    pod = engine(api)
    args = parse_args(pod["containers"][0]["args"], environ={})  # the engine's own parser takes them
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 2, 32, 4)
    assert args.lora_modules_file == "/etc/tokenmill/lora/adapters.json" and not args.lora_modules
    cm = api.objects[("ConfigMap", NS, "chat-lora-adapters")]
    assert json.loads(cm["data"]["adapters.json"]) == [{"name": a["name"], "path": a["uri"]} for a in ADAPTERS]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["lora-adapters"]["configMap"]["name"] == "chat-lora-adapters"
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["lora-adapters"] == {"name": "lora-adapters", "mountPath": "/etc/tokenmill/lora", "readOnly": True}
    assert "subPath" not in mounts["lora-adapters"]  # the kubelet updates only whole-volume mounts
    # the pvc:// adapter's claim is mounted where the engine reads pvc:// uris
    claim = next(v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "adapters")
    assert mounts[claim["name"]]["mountPath"] == "/models/adapters"
    assert status["sizing"]["loraSlotBytes"] > 0
    assert status["lora"]["configMap"] == "chat-lora-adapters"
    assert [a["name"] for a in status["lora"]["adapters"]] == ["sql", "support"]
    assert not any(a["loaded"] for a in status["lora"]["adapters"])


def test_adding_and_removing_adapters_changes_the_configmap_not_the_pod_template():
    api = FakeApi()
    add_isvc(api, lora_service())
    run(api)
    deployment_ready(api)
    template = json.dumps(api.objects[("Deployment", NS, "chat")]["spec"]["template"], sort_keys=True)
    add_isvc(api, lora_service([*ADAPTERS[1:], {"name": "chat-v2", "uri": "hf://acme/chat-v2"}]), generation=2)
    api.writes.clear()
    run(api)
    assert json.dumps(api.objects[("Deployment", NS, "chat")]["spec"]["template"], sort_keys=True) == template
    assert ("apply", "ConfigMap", NS, "chat-lora-adapters") in api.writes
    assert ("apply", "Deployment", NS, "chat") not in api.writes  # no rollout
    names = [e["name"] for e in json.loads(api.objects[("ConfigMap", NS, "chat-lora-adapters")]["data"]["adapters.json"])]
    assert names == ["support", "chat-v2"]
    assert ("Normal", "Updated", "ConfigMap chat-lora-adapters: LoRA adapters support, chat-v2") in api.events


def test_status_lists_each_adapter_from_the_engines_own_metrics():
    api = FakeApi()
    add_isvc(api, lora_service())
    run(api)
    deployment_ready(api)
    make_pods(api, 2)

    def scrape(pods, timeout):  # each pod's /metrics as the engine's exporter renders it
        out = {}
        for i, pod in enumerate(pods):
            m = ServerMetrics("chat", 512)
            m.enable_lora(4)
            failed = {} if i == 0 else {"support": "LoRA adapter 'support': no such folder"}
            m.set_lora_adapters(["sql", "support"] if i == 0 else ["sql"], failed)
            out[pod["metadata"]["name"]] = parse_engine_metrics(m.render()[0].decode())
        return out

    status = run(api, autoscale=True, scrape=scrape)
    by_name = {a["name"]: a for a in status["lora"]["adapters"]}
    assert by_name["sql"] == {"name": "sql", "uri": ADAPTERS[0]["uri"], "loaded": True, "pods": "2/2"}
    assert by_name["support"]["loaded"] is False and by_name["support"]["pods"] == "1/2"
    assert by_name["support"]["reason"] == "LoRA adapter 'support': no such folder"
    assert status["lora"]["loaded"] == 1
    # a pass that reads no pod keeps the last answer
    assert run(api)["lora"] == status["lora"]


def test_sizing_leaves_the_adapter_slots_out_of_the_kv_budget_and_says_so():
    profile, gpu = find_model_profile("Llama-3.1-8B"), GPU_TYPES["nvidia-l4"]
    base = plan(profile, gpu)
    with_lora = plan(profile, gpu, EngineSettings(max_loras=4, max_lora_rank=16))
    assert with_lora.feasible and with_lora.lora_slot_bytes > 0
    want = lora_slot_bytes(profile.num_hidden_layers, profile.hidden_size, profile.num_attention_heads,
                           profile.num_key_value_heads, profile.head_dim, profile.intermediate_size, 4, 16,
                           with_lora.dtype)  # fmt: skip
    assert with_lora.lora_slot_bytes == want
    block = with_lora.block_size * with_lora.kv_bytes_per_token
    assert 0 <= base.kv_cache_bytes - with_lora.kv_cache_bytes - want < block  # whole blocks
    assert "LoRA slots (4 adapters of rank 16)" in with_lora.message
    # the engine's host cache (--max-cpu-loras 8: twice the slots, in the same layout) in the pod's memory
    assert with_lora.host_memory_bytes - base.host_memory_bytes == 2 * want


def test_the_sizing_function_is_what_the_engine_allocates(tmp_path):
    from tokenmill.engine.distributed.parallel_state import SINGLE
    from tokenmill.engine.lora.manager import LoRAModelManager
    from tokenmill.engine.model.loader import load_model
    from tokenmill.engine.model_config import load_model_config

    folder = make_tiny_model(tmp_path, "qwen3", vocab_size=1000)  # head_dim != hidden / heads
    mc = load_model_config(folder)
    model = load_model(folder, mc, torch.float32, "cpu")
    manager = LoRAModelManager(model, mc, SINGLE, max_loras=3, max_lora_rank=8, max_cpu_loras=3, max_rows=16,
                               dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    assert manager.nbytes == lora_slot_bytes(mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads,
                                             mc.num_key_value_heads, mc.head_dim, mc.intermediate_size, 3, 8,
                                             "float32")  # fmt: skip


@pytest.mark.parametrize(("lora", "message"), [
    ({"adapters": [{"name": "a", "uri": "s3://x/y"}]}, "must start with pvc://, hf:// or file://"),
    ({"adapters": [{"name": "a,b", "uri": "hf://x/y"}]}, "without commas or spaces"),
    ({"adapters": [{"name": "a", "uri": "hf://x/y"}, {"name": "a", "uri": "hf://x/z"}]}, "used by an earlier adapter"),
    ({"adapters": [{"name": "chat", "uri": "hf://x/y"}]}, "is the served model's name"),
    ({"adapters": [], "maxRank": 1024}, "maxRank must be 1 to 512"),
])  # fmt: skip
def test_bad_lora_specs_are_refused_by_name(lora, message):
    spec = smol()
    spec["model"]["lora"] = lora
    body = {"metadata": {"name": "chat", "namespace": NS}, "spec": spec}
    with pytest.raises(SpecError, match=message):
        parse_inference_service(body)


def test_a_token_and_cache_for_hub_adapters_on_a_non_hub_model():
    spec = lora_service()
    spec["model"]["tokenSecretRef"] = {"name": "hf-token"}
    parsed = parse_inference_service({"metadata": {"name": "chat", "namespace": NS}, "spec": spec})
    assert parsed.token_secret == ("hf-token", "HF_TOKEN")
    spec["model"]["lora"]["adapters"] = ADAPTERS[1:]  # pvc only: no token to give
    with pytest.raises(SpecError, match="hf:// LoRA adapters"):
        parse_inference_service({"metadata": {"name": "chat", "namespace": NS}, "spec": spec})
