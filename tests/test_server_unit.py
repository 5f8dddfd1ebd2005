"""Fast tests of the server's parts without a model: CLI and environment, the IPC wire format, the
engine-core busy loop (against a small fake core, beside the real-process tests), metrics rendering,
OpenAI-format errors and auth on the app, and admission counting."""

import asyncio
import time
import types

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenmill.engine import metric_names
from tokenmill.engine.cli import serve as serve_cli
from tokenmill.engine.core import EngineCoreOutput, EngineCoreRequest, SchedulerStats, proc, wire
from tokenmill.engine.core.client import EngineInfo, StepOutputs
from tokenmill.engine.core.engine_core import EngineCapacity
from tokenmill.engine.frontend.async_llm import AsyncLLM, QueueFullError
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.app import build_app
from tokenmill.engine.server.errors import validation_message
from tokenmill.engine.server.prometheus import ServerMetrics
from tokenmill.engine.server.request_params import resolve_max_tokens
from tokenmill.engine.server.state import ServerState

CAPACITY = EngineCapacity(
    num_kv_blocks=100, block_size=16, kv_tokens=1600, max_model_len=400, max_num_seqs=8,
    max_num_batched_tokens=512, max_concurrency=4.0, model_load_seconds=1.5, dtype="float32", device="cpu",
)  # fmt: skip


# ---- CLI and environment -------------------------------------------------------------------------
def test_flags_defaults_and_env_with_command_line_winning():
    args = serve_cli.parse_args([], environ={})
    assert (args.host, args.port, args.api_key, args.served_model_name) == (
        "127.0.0.1", 8000, None, [serve_cli.DEFAULT_MODEL_NAME])  # fmt: skip
    env = {
        "TOKENMILL_API_KEY": "k1",
        "TOKENMILL_MAX_NUM_SEQS": "7",
        "TOKENMILL_ENABLE_PREFIX_CACHING": "false",
        "TOKENMILL_REQUIRE_AUTH_FOR_METRICS": "1",
        "TOKENMILL_SERVED_MODEL_NAME": "a,b",
        "TOKENMILL_KV_CACHE_MEMORY": "2GiB",
        "TOKENMILL_PORT": "9001",
    }
    args = serve_cli.parse_args(["--port", "9002"], environ=env)
    assert args.api_key == "k1" and args.max_num_seqs == 7 and args.port == 9002
    assert args.enable_prefix_caching is False and args.require_auth_for_metrics is True
    assert args.served_model_name == ["a", "b"] and args.kv_cache_memory == 2 * 2**30
    config = serve_cli.engine_config(args)
    assert (
        config.max_num_seqs == 7 and config.kv_cache_memory == 2 * 2**30 and not config.enable_prefix_caching
    )


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--num-kv-blocks", "10", "--kv-cache-memory", "1GiB"], {}),
        (["--num-kv-blocks", "10"], {"TOKENMILL_KV_CACHE_MEMORY": "1GiB"}),
        ([], {"TOKENMILL_MAX_NUM_SEQS": "many"}),
        ([], {"TOKENMILL_DTYPE": "float8"}),
        ([], {"TOKENMILL_ENABLE_PREFIX_CACHING": "maybe"}),
        (["--max-num-seqs", "0"], {}),
        (["--port", "70000"], {}),
        (["--kv-cache-memory", "lots"], {}),
        (["--tensor-parallel-size", "0"], {}),
    ],
)
def test_bad_flags_exit_with_usage_error(argv, env, capsys):
    with pytest.raises(SystemExit) as e:
        serve_cli.parse_args(argv, environ=env)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [("1024", 1024), ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20),
                                                ("1e9", 10**9), ("3G", 3 * 10**9), ("4kb", 4000)])  # fmt: skip
def test_parse_bytes(text, expected):
    assert serve_cli.parse_bytes(text) == expected


# ---- IPC wire format -----------------------------------------------------------------------------
def test_wire_format_round_trips_every_message():
    params = SamplingParams(n=2, temperature=0.5, stop=["x"], logit_bias={5: -1.0}, logprobs=2, seed=3)
    req = EngineCoreRequest("r1", [1, 2, 3], params, 12.5, priority=1)
    kind, back = wire.decode(wire.encode((wire.ADD, req)))
    assert kind == wire.ADD and back == req

    outs = [EngineCoreOutput("r1", 1, [7], [(-0.5, [(7, -0.5), (9, -1.25)])], "stop", 7, 16)]
    stats = SchedulerStats(2, 1, 0.25, 1, 32, 16, 40, num_compiling=3, queue_times=[("r1", 0.01)])
    kind, outs_back, stats_back = wire.decode(wire.encode((wire.OUTPUTS, outs, stats)))
    assert outs_back == outs and stats_back == stats
    assert isinstance(outs_back[0].new_logprobs[0], tuple) and isinstance(stats_back.queue_times[0], tuple)

    assert wire.decode(wire.encode((wire.READY, CAPACITY, [2]))) == (
        wire.READY,
        CAPACITY,
        [2],
    )
    for msg in [(wire.ABORT, ["a", "b"]), (wire.SHUTDOWN,), (wire.REJECT, "r", "too long", True),
                (wire.STARTUP_ERROR, "no model"), (wire.FATAL, "boom")]:  # fmt: skip
        assert wire.decode(wire.encode(msg)) == msg


# ---- the busy loop against a fake core -------------------------------------------------------------
class FakeCore:
    """Emits one token per step per request until max_tokens; rejects prompts longer than 10."""

    capacity = CAPACITY

    def __init__(self) -> None:
        self.reqs: dict[str, list] = {}
        self.steps = 0

    def add_request(self, req: EngineCoreRequest) -> None:
        if len(req.prompt_token_ids) > 10:
            raise ValueError(f"the prompt has {len(req.prompt_token_ids)} tokens, longer than 10")
        self.reqs[req.request_id] = [req.sampling_params.max_tokens, 0]

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def num_kv_blocks_in_use(self) -> int:
        return len(self.reqs)

    def step(self):
        self.steps += 1
        outs = []
        for rid, st in list(self.reqs.items()):
            st[1] += 1
            done = st[1] >= st[0]
            outs.append(EngineCoreOutput(rid, 0, [st[1]], finish_reason="length" if done else None))
            if done:
                del self.reqs[rid]
        return outs, SchedulerStats(num_running=len(self.reqs))


def _run_loop(core, inbox: list[list[tuple]], parent_alive=lambda: True) -> list[tuple]:
    sent: list[tuple] = []

    def recv(_timeout: float) -> list[tuple]:
        return (
            inbox.pop(0) if inbox else [(wire.SHUTDOWN,)] if not core.has_unfinished_requests() else []
        )

    assert proc.run_busy_loop(core, recv, sent.append, parent_alive) == "shutdown"
    return sent


def test_busy_loop_steps_while_work_remains_and_rejects_bad_requests():
    core = FakeCore()
    inbox = [[(wire.ADD, EngineCoreRequest("a", [1], SamplingParams(max_tokens=3), 0.0)),
              (wire.ADD, EngineCoreRequest("bad", [1] * 11, SamplingParams(), 0.0))]]  # fmt: skip
    sent = _run_loop(core, inbox)
    assert sent[0] == (wire.REJECT, "bad", "the prompt has 11 tokens, longer than 10", True)
    tokens = [o.new_token_ids[0] for m in sent[1:] for o in m[1]]
    assert tokens == [1, 2, 3] and core.steps == 3
    assert sent[-1][1][0].finish_reason == "length"


def test_busy_loop_reports_zero_usage_after_an_abort_empties_it():
    core = FakeCore()
    add = (wire.ADD, EngineCoreRequest("a", [1], SamplingParams(max_tokens=100), 0.0))
    inbox = [[add], [(wire.ABORT, ["a"])]]
    sent = _run_loop(core, inbox)
    assert sent[-1][0] == wire.OUTPUTS and sent[-1][1] == []
    assert sent[-1][2].kv_cache_usage == 0.0 and sent[-1][2].num_running == 0
    assert core.steps == 1


def test_busy_loop_exits_when_the_parent_is_gone(monkeypatch):
    monkeypatch.setattr(proc, "PARENT_CHECK_S", 0.0)
    core = FakeCore()
    sent: list[tuple] = []
    assert proc.run_busy_loop(core, lambda _t: [], sent.append, parent_alive=lambda: False) == "orphaned"
    assert sent == []


# ---- metrics -------------------------------------------------------------------------------------
def test_cache_config_info_names_what_the_kv_pool_holds():
    """vLLM's cache_dtype label: the resolved cache dtype (fp8 given, fp8_e4m3 held), so a dashboard sees
    an 8-bit pool's blocks for what they are."""
    import dataclasses

    m = ServerMetrics("m", 400)
    m.set_capacity(dataclasses.replace(CAPACITY, kv_cache_dtype="fp8", kv_cache_dtype_resolved="fp8_e4m3"), True)
    [info] = [s for f in text_string_to_metric_families(m.render()[0].decode()) for s in f.samples
              if s.name == "vllm:cache_config_info"]  # fmt: skip
    assert info.labels["cache_dtype"] == "fp8_e4m3" and info.labels["num_gpu_blocks"] == "100"


def test_metrics_render_every_contract_name_with_the_model_label():
    m = ServerMetrics("my-model", 400)
    m.set_capacity(CAPACITY, enable_prefix_caching=True)
    m.record_step(
        SchedulerStats(3, 2, 0.5, 1, 64, 32, 20, [("a", 0.2)]), num_new_tokens=3, num_preprocessing=1
    )
    m.record_first_token(0.1, 12)
    m.record_inter_token(0.02)
    m.record_finished(1.0, 12, 5, ["stop", "length"])
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    # the LoRA gauges exist with --enable-lora only (vllm:lora_requests_info without model_name, as in vLLM):
    # tests/test_lora_serve.py
    contract = {getattr(metric_names, n) for n in dir(metric_names) if n.isupper() and n not in ("LABEL_MODEL", "LORA_REQUESTS_INFO", "LORA_ADAPTER_INFO")}
    assert contract <= set(families)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    label = (("model_name", "my-model"),)
    assert samples[("vllm:num_requests_waiting", label)] == 3  # scheduler's 2 + 1 being tokenized
    assert samples[("vllm:kv_cache_usage_perc", label)] == 0.5
    assert samples[("vllm:generation_tokens_total", label)] == 3
    assert samples[("vllm:prefix_cache_hits_total", label)] == 32
    assert samples[("tokenmill:kv_cache_capacity_tokens", label)] == 1600
    assert (
        samples[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "my-model")))]
        == 1
    )
    info = [k for k in samples if k[0] == "vllm:cache_config_info"]
    assert dict(info[0][1])["num_gpu_blocks"] == "100" and dict(info[0][1])["block_size"] == "16"
    assert dict(info[0][1])["cache_dtype"] == "float32"  # the model's dtype: no --kv-cache-dtype given
    for f in families.values():
        assert all(s.labels.get("model_name") == "my-model" for s in f.samples), f.name


# ---- errors, auth and state on the app (no engine: the model is "loading") -------------------------
@pytest.fixture
def app_client():
    state = ServerState(served_model_names=["m"], api_key="sekrit")
    transport = httpx.ASGITransport(app=build_app(state))

    async def call(method: str, path: str, **kw) -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return state, lambda *a, **kw: asyncio.run(call(*a, **kw))


AUTH = {"Authorization": "Bearer sekrit"}


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_app_while_loading_answers_503_and_health_says_so(app_client):
    _state, call = app_client
    r = call("GET", "/health")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    err = _error(call("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                      headers=AUTH), 503)  # fmt: skip
    assert "loading" in err["message"]
    assert call("GET", "/metrics").status_code == 503


def test_app_auth_401_format_and_open_paths(app_client):
    state, call = app_client
    err = _error(call("POST", "/v1/completions", json={}), 401)
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    # auth runs before body parsing: a keyless client learns about the key first
    _error(call("POST", "/v1/completions", content=b"{", headers={"content-type": "application/json"}), 401)
    _error(call("POST", "/tokenize", json={}, headers={"Authorization": "Bearer nope"}), 401)
    assert call("GET", "/version").status_code == 200
    assert call("GET", "/health").status_code == 503  # open, just not ready
    state.require_auth_for_metrics = True
    _error(call("GET", "/metrics"), 401)


def test_app_validation_errors_are_openai_400s(app_client):
    _state, call = app_client
    err = _error(call("POST", "/v1/completions", content=b'{"prompt": ', headers=AUTH | {
        "content-type": "application/json"}), 400)  # fmt: skip
    assert "JSON" in err["message"]
    err = _error(
        call("POST", "/v1/completions", json={"prompt": "x", "max_tokens": "many"}, headers=AUTH), 400
    )
    assert err["param"] == "max_tokens"
    err = _error(call("POST", "/v1/chat/completions", json={"messages": "hi"}, headers=AUTH), 400)
    assert err["param"] == "messages"
    err = _error(call("GET", "/v1/nope", headers=AUTH), 404)
    assert "/v1/nope" in err["message"]
    _error(call("GET", "/v1/chat/completions", headers=AUTH), 405)


def test_unknown_model_is_404_before_anything_else(app_client):
    _state, call = app_client
    err = _error(call("POST", "/v1/completions", json={"model": "other", "prompt": "x"}, headers=AUTH), 404)
    assert err["code"] == "model_not_found" and "`other`" in err["message"] and "m" in err["message"]


def test_validation_message_names_fields():
    message, param = validation_message([
        {"loc": ("body", "temperature"), "msg": "Input should be a valid number", "type": "float_parsing"}
    ])  # fmt: skip
    assert param == "temperature" and "temperature: Input should be a valid number" == message


def test_max_tokens_resolution_names_both_lengths():
    assert resolve_max_tokens(10, None, 400, "prompt", "max_tokens") == 390
    assert resolve_max_tokens(10, 390, 400, "prompt", "max_tokens") == 390
    with pytest.raises(Exception) as e:
        resolve_max_tokens(10, 391, 400, "prompt", "max_tokens")
    assert e.value.status == 400 and "401" in e.value.message and "400" in e.value.message
    with pytest.raises(Exception) as e:
        resolve_max_tokens(400, None, 400, "prompt", "max_tokens")
    assert e.value.param == "prompt" and "400 tokens" in e.value.message


# ---- admission is counted before any work ------------------------------------------------------------
class _NoTokenizer:
    """Admission must not touch the tokenizer at all; any use fails the test."""

    backend_tokenizer = None

    def __getattr__(self, name):
        raise AssertionError(f"tokenizer.{name} used during admission")

    def __deepcopy__(self, memo):
        return self


def test_admission_counts_before_tokenization_and_releases():
    async def run() -> None:
        engine = AsyncLLM(
            types.SimpleNamespace(), _NoTokenizer(), EngineInfo(CAPACITY, [2]), max_waiting_requests=2
        )
        engine.admit(["a"])
        engine.admit(["b", "c"])  # a multi-prompt request is admitted as a whole
        assert engine.num_unscheduled == 3 and engine.num_in_flight == 3
        with pytest.raises(QueueFullError) as e:
            engine.admit(["d"])
        assert "3 requests are already waiting" in str(e.value) and "--max-waiting-requests 2" in str(e.value)
        engine.release(["a", "b"])
        engine.admit(["d"])
        engine.release(["c", "d"])
        assert engine.num_unscheduled == 0 and engine.num_in_flight == 0
        await engine.close()

    asyncio.run(run())


def test_a_core_that_steps_without_scheduling_anything_counts_as_stalled():
    """A scheduler deadlock leaves the core looping: a message per step, nothing computed. /health reads
    stalled_for, so such steps must not reset it; a step that computes tokens (or a grammar compiling)
    does."""

    class Client:
        def __init__(self) -> None:
            self.steps: asyncio.Queue = asyncio.Queue()

        def add_request(self, req) -> None:
            pass

        def abort_requests(self, ids) -> None:
            pass

        async def get_output(self):
            return await self.steps.get()

    def step(tokens: int = 0, compiling: int = 0) -> StepOutputs:
        return StepOutputs([], SchedulerStats(num_running=0, num_waiting=1, num_scheduled_tokens=tokens,
                                              num_compiling=compiling))  # fmt: skip

    async def run() -> None:
        client = Client()
        engine = AsyncLLM(client, _NoTokenizer(), EngineInfo(CAPACITY, [2]))
        engine.processor.add_request = lambda *a, **k: None
        engine.start()
        gen = engine.generate("r", None, [5, 6], SamplingParams(max_tokens=4))
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        t0 = time.monotonic()
        for _ in range(20):  # 0.2 s of empty steps
            client.steps.put_nowait(step())
            await asyncio.sleep(0.01)
        assert engine.stalled_for() >= time.monotonic() - t0 - 0.01
        client.steps.put_nowait(step(compiling=1))
        await asyncio.sleep(0.01)
        assert engine.stalled_for() < 0.1
        await asyncio.sleep(0.15)
        client.steps.put_nowait(step(tokens=2))
        await asyncio.sleep(0.01)
        assert engine.stalled_for() < 0.1
        pending.cancel()
        await engine.close()

    asyncio.run(run())


def test_a_template_error_is_a_400_on_chat_render_and_tokenize(bundled_model_dir):
    """A chat template that refuses the messages (as Llama-2's does for roles out of order) is the
    client's 400 on every route that renders it; /tokenize answered 500 before."""
    from tokenmill.engine.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(bundled_model_dir)
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"

    async def run() -> list[httpx.Response]:
        engine = AsyncLLM(types.SimpleNamespace(), tokenizer, EngineInfo(CAPACITY, [2]))
        engine.admit = engine.release = lambda ids, *_lora: (
            None
        )  # nothing reaches generate(): the template fails first
        state = ServerState(served_model_names=["m"], engine=engine, tokenizer=tokenizer, vocab_size=100,
                            max_model_len=400, max_num_seqs=8, status="ready")  # fmt: skip
        transport = httpx.ASGITransport(app=build_app(state))
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            out = [await c.post(path, json=body) for path in
                   ("/tokenize", "/v1/chat/completions/render", "/v1/chat/completions")]  # fmt: skip
        await engine.close()
        return out

    for r in asyncio.run(run()):
        err = _error(r, 400)
        assert err["param"] == "messages" and "roles must alternate" in err["message"], err
