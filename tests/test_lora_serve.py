"""LoRA adapters through a real `tokenmill serve` and the official openai client: a request picks an
adapter by `model` and gets PEFT's tokens; /v1/models lists adapters with their parent; runtime loading
behind its flag; every refusal an OpenAI-format 4xx that names the problem; vllm:lora_requests_info as
vLLM exposes it."""

import asyncio
import json
import shutil
import threading
import time

import httpx
import openai
import pytest
from conftest_server import serving
from lora_adapters import make_peft_adapter, peft_greedy
from tiny_models import make_tiny_model
from tokenmill.engine.server.app import build_app
from tokenmill.engine.server.lora import LoRAServing, parse_lora_module, runtime_updates_allowed
from tokenmill.engine.server.state import ServerState

PROMPT = [1, 5, 9, 200, 300, 17, 18, 19, 20, 21, 22]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = make_tiny_model(root, "llama")  # with the bundled model's tokenizer
    other = make_tiny_model(root / "q3", "qwen3", vocab_size=1000)
    return {
        "root": root,
        "base": base,
        "a": make_peft_adapter(base, root / "a", r=8, seed=1),
        "b": make_peft_adapter(base, root / "b", r=4, seed=2, targets=("q_proj", "v_proj"), use_rslora=True),
        "c": make_peft_adapter(base, root / "c", r=8, seed=3, targets=("gate_proj", "down_proj")),
        "rank16": make_peft_adapter(base, root / "r16", r=16, seed=4),
        "other_model": make_peft_adapter(other, root / "q3a", r=8, targets=("q_proj",)),
    }


@pytest.fixture(scope="module")
def modules_file(files):
    path = files["root"] / "modules.json"
    path.write_text(json.dumps([{"name": "f1", "path": str(files["c"])}, {"name": "broken", "path": "/nonexistent"}]))
    return path


@pytest.fixture(scope="module")
def server(files, modules_file, tmp_path_factory):
    yield from serving(
        "--model", str(files["base"]), "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "512",
        "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2",
        "--lora-modules", f"a={files['a']}", json.dumps({"name": "b", "path": str(files["b"])}),
        "--lora-modules-file", str(modules_file),
        "--allow-runtime-lora-updating", log_dir=tmp_path_factory.mktemp("serve"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, model: str) -> tuple[str, str]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.model, r.choices[0].text


@pytest.fixture(scope="module")
def want(files):
    """PEFT's greedy text for PROMPT under the base model (None) and each adapter."""
    from tokenmill.engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(files["base"])
    out = {}
    for name in (None, "a", "b", "c"):
        ids = peft_greedy(files["base"], files[name] if name else None, [PROMPT], MAX_TOKENS)[0]
        out[name] = tok.decode(ids)
    assert len(set(out.values())) == len(out)  # every adapter changes the answer
    return out


def _error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def test_models_lists_adapters_with_their_parent(server, files):
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    cards = {m["id"]: m for m in data}
    base = data[0]["id"]
    assert set(cards) == {base, "a", "b", "f1"}
    assert cards[base]["parent"] is None
    assert cards["a"]["parent"] == base and cards["b"]["parent"] == base
    assert cards["a"]["root"] == str(files["a"])


def test_each_model_name_gets_its_adapters_tokens(server, client, want):
    base_name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    for name in (None, "a", "b"):
        assert _complete(client, name or base_name) == (name or base_name, want[name])
    # the chat route picks the adapter the same way, and reports it
    r = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.model == "a" and r.usage.completion_tokens == 4


def test_unknown_adapter_is_404_listing_what_is_served(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    err = _error(r, 404, "The model `nope` does not exist", "a", "b")
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_runtime_load_and_unload_with_their_refusals(server, client, files, want):
    def load(name: str, path) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                          timeout=60)  # fmt: skip

    _error(load("big", files["rank16"]), 400, "its rank is 16", "--max-lora-rank 8")
    _error(load("q3", files["other_model"]), 400, "is the adapter for another base model?")
    _error(load("a", files["c"]), 400, "The lora adapter 'a' has already been loaded.")
    _error(load("x", files["root"] / "missing"), 400, "not found")
    bad = shutil.copytree(files["c"], files["root"] / "c-attn")
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["c_attn"]}))
    _error(load("gpt2ish", bad), 400, "target module 'c_attn'")

    r = load("c", files["c"])
    assert r.status_code == 200 and "added successfully" in r.text
    assert _complete(client, "c") == ("c", want["c"])
    assert "c" in {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and "removed successfully" in r.text
    _error(httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 1}), 404)
    _error(httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"}), 404, "cannot be found")
    # loaded again under the same name: a new adapter id, the same tokens
    assert load("c", files["c"]).status_code == 200
    assert _complete(client, "c") == ("c", want["c"])
    httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"})


def test_a_pool_full_of_adapters_in_use_is_429_and_the_gauge_shows_them(server, client, files):
    # Two adapters hold long streams (max_cpu_loras 2): a third adapter has no room until one ends.
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(files["c"])},
                      timeout=60).status_code == 200  # fmt: skip
    started = [threading.Event(), threading.Event()]
    stop = threading.Event()

    def hold(i: int, model: str) -> None:
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        for _ in stream:
            started[i].set()
            if stop.is_set():
                break
        stream.close()

    threads = [threading.Thread(target=hold, args=(i, m)) for i, m in enumerate(("a", "b"))]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(120) for e in started)
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 1})
        err = _error(r, 429, "LoRA adapter 'c' cannot be served now", "--max-cpu-loras 2", "a, b")
        assert err["code"] == "lora_pool_full" and r.headers["retry-after"] == "1"
        # the base model and the adapters in use still answer
        assert _complete(client, "a")[0] == "a"
        info = [(k, v) for k, v in server.metrics().items() if k.startswith("vllm:lora_requests_info")]
        assert len(info) == 1
        labels, value = info[0]
        assert "max_lora=2" in labels
        assert "running_lora_adapters=a,b" in labels or "running_lora_adapters=b,a" in labels
        assert abs(value - time.time()) < 60
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    # once the streams are gone, c has room
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 1})
        if r.status_code == 200:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text


def test_the_modules_file_is_followed_without_a_restart(server, client, files, modules_file, want):
    def adapter_info() -> dict[str, str]:
        return {k: v for k, v in server.metrics().items() if k.startswith("tokenmill:lora_adapter_info")}

    info = adapter_info()
    assert "tokenmill:lora_adapter_info{lora_name=f1,reason=,status=loaded}" in info
    failed = [k for k in info if "lora_name=broken" in k]
    assert len(failed) == 1 and "status=failed" in failed[0] and "/nonexistent" in failed[0]
    assert _complete(client, "f1") == ("f1", want["c"])

    # The kubelet swaps a ConfigMap's files by rename: f1 goes, f2 comes (a's weights), broken is fixed.
    new = modules_file.with_suffix(".new")
    new.write_text(json.dumps([{"name": "f2", "path": str(files["a"])}, {"name": "broken", "path": str(files["b"])}]))
    new.replace(modules_file)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        if "f2" in names and "f1" not in names and "broken" in names:
            break
        time.sleep(0.5)
    assert {"f2", "broken"} <= names and "f1" not in names
    assert _complete(client, "f2") == ("f2", want["a"]) and _complete(client, "broken") == ("broken", want["b"])
    assert all("status=loaded" in k for k in adapter_info())
    assert server.proc.poll() is None


# ---- pieces, no server ---------------------------------------------------------------------------------
def test_runtime_routes_are_off_without_the_flag_and_say_how_to_turn_them_on(files):
    from tokenmill.engine.model_config import load_model_config

    state = ServerState(served_model_names=["m"])
    state.status = "ready"
    state.lora = LoRAServing("m", load_model_config(files["base"]), 2, 8, 2, allow_runtime_updates=False)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(files["a"])})

    _error(asyncio.run(call()), 404, "--allow-runtime-lora-updating", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true")
    state.lora = None
    _error(asyncio.run(call()), 400, "start it with --enable-lora")


def test_flags_parse_as_vllms():
    from tokenmill.engine.cli.serve import parse_args

    assert parse_lora_module("sql=/a/b").path == "/a/b"
    assert parse_lora_module('{"name": "sql", "path": "hf://org/sql-lora", "base_model_name": "m"}').name == "sql"
    for bad in ("sql", "=x", '{"name": 1}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    args = parse_args(["--lora-modules", "a=/x", "b=/y", "--max-loras", "2"], environ={})
    assert args.enable_lora and [m.name for m in args.lora_modules] == ["a", "b"]
    assert not args.allow_runtime_lora_updating
    assert runtime_updates_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    with pytest.raises(SystemExit):
        parse_args(["--lora-modules", "a=/x", "a=/y"], environ={})
    with pytest.raises(SystemExit):
        parse_args(["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], environ={})


def test_the_lora_gauge_reads_as_vllms_under_both_endpoint_picker_rules(monkeypatch):
    """vLLM keeps every label set it ever wrote (value: the time it last wrote it); the endpoint picker v1.5.0
    takes the series with the largest value, among all (its datalayer extractor) or among those naming an
    adapter (its older metrics client). Ours keeps two series; both rules must pick what they pick in vLLM's."""
    from prometheus_client.parser import text_string_to_metric_families
    from tokenmill.engine.core import SchedulerStats
    from tokenmill.engine.server import prometheus
    from tokenmill.engine.server.prometheus import ServerMetrics

    clock = iter(range(1_000, 2_000))
    monkeypatch.setattr(prometheus.time, "time", lambda: float(next(clock)))
    m = ServerMetrics("m", 512)
    m.enable_lora(2)
    vllm: dict[tuple, float] = {}  # vLLM's exposition: every label set, its last time
    steps = [({"a": 1}, {}), ({"a": 2}, {"b": 1}), ({}, {}), ({"b": 1}, {}), ({}, {}), ({}, {}), ({"a": 1}, {"c": 3})]
    for running, waiting in steps:
        m.record_step(SchedulerStats(running_lora_adapters=running, waiting_lora_adapters=waiting), 0, 0)
        ours = {}
        for f in text_string_to_metric_families(m.render()[0].decode()):
            for s in f.samples:
                if s.name == "vllm:lora_requests_info":
                    ours[(s.labels["max_lora"], s.labels["waiting_lora_adapters"], s.labels["running_lora_adapters"])] = s.value
        newest = max(ours.values())
        vllm[next(k for k, v in ours.items() if v == newest)] = newest
        assert len(ours) <= 2

        def latest(series: dict, named_only: bool):
            named = {k: v for k, v in series.items() if not named_only or k[1] or k[2]}
            return max(named, key=named.get) if named else None

        for named_only in (False, True):
            assert latest(ours, named_only) == latest(vllm, named_only), (running, waiting, named_only)
