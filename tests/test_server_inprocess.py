"""AsyncLLM over the in-process engine client, with the real bundled model (fp32): generation,
aborts that free KV blocks, stop strings aborting in the core, rejected requests, tokenization off
the event loop, the app's routes over ASGI, and engine failure reaching every in-flight request."""

import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.client import EngineDeadError, InprocClient
from tokenmill.engine.frontend.async_llm import AsyncLLM, RequestAbortedError, RequestRejectedError
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.app import build_app
from tokenmill.engine.server.prometheus import ServerMetrics
from tokenmill.engine.server.state import ServerState

# engine.md's greedy fp32 continuation of "Once upon a time"
ONCE_UPON = (
    ", the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling streets. "
    "But as the years went by, the city began to lose"
)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, bundled_model_dir):
    from tokenmill.engine.model.tokenizer import load_tokenizer

    config = EngineConfig(model=str(bundled_model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    client = InprocClient(config)
    info = loop.run_until_complete(client.start())
    dead: list[EngineDeadError] = []
    metrics = ServerMetrics("m", info.capacity.max_model_len)
    llm = AsyncLLM(client, load_tokenizer(bundled_model_dir), info, max_waiting_requests=8, metrics=metrics,
                   on_dead=dead.append)  # fmt: skip
    loop.run_until_complete(_start(llm))
    llm.dead_list = dead
    yield llm
    loop.run_until_complete(llm.close())
    client.shutdown()


async def _start(llm: AsyncLLM) -> None:
    llm.start()


def _wait_core_idle(llm: AsyncLLM, loop, timeout_s: float = 30.0) -> None:
    core = llm.client.core
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.05))
        if not core.has_unfinished_requests() and core.num_kv_blocks_in_use() == 0:
            return
    raise AssertionError(f"core still holds {core.num_kv_blocks_in_use()} blocks")


async def _collect(llm: AsyncLLM, rid: str, prompt: str, params: SamplingParams):
    ids = await llm.encode(prompt)
    llm.admit([rid])
    outs = [o async for o in llm.generate(rid, prompt, ids, params)]
    return outs


def test_generate_greedy_text_and_blocks_freed(engine, loop):
    outs = loop.run_until_complete(
        _collect(engine, "g1", "Once upon a time", SamplingParams(temperature=0, max_tokens=12))
    )
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # append-only
    assert ONCE_UPON.startswith(texts[-1]) and len(texts[-1]) > 20
    assert engine.num_in_flight == 0 and engine.num_unscheduled == 0
    _wait_core_idle(engine, loop)


def test_closing_the_generator_aborts_in_the_core(engine, loop):
    async def run() -> None:
        ids = await engine.encode("Tell me a story")
        engine.admit(["c1"])
        gen = engine.generate("c1", None, ids, SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        await gen.__anext__()
        assert engine.client.core.num_kv_blocks_in_use() > 0
        await gen.aclose()

    loop.run_until_complete(run())
    assert engine.num_in_flight == 0
    _wait_core_idle(engine, loop)


def test_cancelling_the_consumer_aborts_in_the_core(engine, loop):
    async def run() -> None:
        ids = await engine.encode("Tell me a story")
        engine.admit(["k1"])

        async def consume() -> None:
            async for _ in engine.generate("k1", None, ids, SamplingParams(max_tokens=200, ignore_eos=True)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop.run_until_complete(run())
    _wait_core_idle(engine, loop)


def test_stop_string_finishes_upstream_and_aborts_in_the_core(engine, loop):
    outs = loop.run_until_complete(
        _collect(
            engine, "s1", "Once upon a time", SamplingParams(temperature=0, max_tokens=100, stop=[" city"])
        )
    )
    assert outs[-1].outputs[0].text == ", the" and outs[-1].outputs[0].finish_reason == "stop"
    _wait_core_idle(engine, loop)  # the core's sequence (max_tokens 100) was aborted, not run out


def test_rejected_by_the_core(engine, loop):
    with pytest.raises(RequestRejectedError) as e:
        loop.run_until_complete(
            _collect(engine, "r1", "hi", SamplingParams(max_tokens=4, stop_token_ids=[10**7]))
        )
    assert e.value.client_error and "stop_token_ids" in str(e.value)
    assert engine.num_in_flight == 0


def test_tokenization_runs_off_the_event_loop(engine, loop):
    long_text = "word " * 200_000
    ticks = 0
    threads: set[str] = set()
    original = engine.tokenizer.encode

    def spy(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return original(*args, **kwargs)

    async def run() -> int:
        nonlocal ticks
        engine.tokenizer.encode = spy
        try:
            task = asyncio.ensure_future(engine.encode(long_text))
            while not task.done():
                ticks += 1
                await asyncio.sleep(0)
            return len(task.result())
        finally:
            del engine.tokenizer.encode

    n = loop.run_until_complete(run())
    assert n >= 200_000
    assert threads and all(t.startswith("tokenizer") for t in threads)
    assert ticks > 1  # the loop kept running other work while the long prompt tokenized


def test_app_routes_over_asgi_with_the_in_process_engine(engine, loop):
    state = ServerState(served_model_names=["m"], engine=engine, tokenizer=engine.tokenizer, vocab_size=len(engine.tokenizer),
                        max_model_len=256, max_num_seqs=64, status="ready", metrics=engine.metrics)  # fmt: skip
    transport = httpx.ASGITransport(app=build_app(state))

    async def run() -> tuple:
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            chat = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 20})  # fmt: skip
            stream = await c.post("/v1/completions", json={
                "prompt": "Once upon a time", "temperature": 0, "max_tokens": 8, "stream": True})  # fmt: skip
            metrics = await c.get("/metrics")
            return chat, stream, metrics

    chat, stream, metrics = loop.run_until_complete(run())
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    events = [line for line in stream.text.split("\n") if line]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert ONCE_UPON.startswith(text) and text
    assert "vllm:num_requests_running" in metrics.text
    _wait_core_idle(engine, loop)


def test_abort_all_ends_every_request_and_frees_blocks(engine, loop):
    """What shutdown does when the grace period runs out."""

    async def run() -> None:
        ids = await engine.encode("Tell me a story")
        engine.admit(["x1", "x2", "x3"])
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        gens = [engine.generate(rid, None, ids, params) for rid in ("x1", "x2")]
        for g in gens:
            await g.__anext__()
        assert engine.abort_all("grace period over") == 2
        for g in gens:
            with pytest.raises(RequestAbortedError, match="grace period over"):
                await g.__anext__()
        with pytest.raises(RequestAbortedError):  # nothing new starts once shutdown aborted everything
            await engine.generate("x3", None, ids, params).__anext__()
        assert engine.num_in_flight == 0

    try:
        loop.run_until_complete(run())
    finally:
        engine._abort_reason = None  # the module's engine serves the next test
    _wait_core_idle(engine, loop)


def test_engine_failure_fails_every_in_flight_request(engine, loop):
    """Last in this module: it breaks the shared engine on purpose."""
    core = engine.client.core
    started = threading.Event()
    real_step = core.step

    def failing_step():
        if started.is_set():
            raise RuntimeError("simulated CUDA error")
        return real_step()

    core.step = failing_step

    async def run() -> list:
        ids = await engine.encode("Tell me a story")
        engine.admit(["d1", "d2"])
        gens = [
            engine.generate(rid, None, ids, SamplingParams(max_tokens=100, ignore_eos=True))
            for rid in ("d1", "d2")
        ]

        async def drain(gen):
            try:
                async for _ in gen:
                    started.set()
            except EngineDeadError as e:
                return e
            return None

        return await asyncio.wait_for(asyncio.gather(*(drain(g) for g in gens)), timeout=60)

    errors = loop.run_until_complete(run())
    assert all(isinstance(e, EngineDeadError) and "simulated CUDA error" in str(e) for e in errors), errors
    assert engine.dead_list and "simulated CUDA error" in str(engine.dead_list[0])
    with pytest.raises(EngineDeadError):
        engine.admit(["late"])
