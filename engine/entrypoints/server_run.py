"""The running `tokenmill serve`: uvicorn with tokenmill's drain and exit codes, and the bring-up of the
engine behind it (serve_cli.py parses the flags and may have launched the engine core already).

Apart from serve_cli.py so that the flags are parsed and the engine core is started before this
module's imports (uvicorn, FastAPI, the API routes: about a second here), which then overlap the core's.
"""

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from types import FrameType

import uvicorn
from fastapi import FastAPI
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.core_client import EngineDeadError, InprocClient, MPClient
from tokenmill.engine.entrypoints.api_server import build_app
from tokenmill.engine.entrypoints.health import HealthConfig
from tokenmill.engine.entrypoints.metrics import ServerMetrics
from tokenmill.engine.entrypoints.serve_cli import engine_config, seconds_since_process_start
from tokenmill.engine.entrypoints.server_state import ServerState
from tokenmill.engine.entrypoints.tool_request import template_uses_tools
from tokenmill.engine.generation_config import default_sampling_params, describe
from tokenmill.engine.model_source import parse_model_source
from tokenmill.engine.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.serve")

DEATH_EXIT_DELAY_S = 1.0  # lets the 500s of failed requests reach their clients before the process exits


class Server(uvicorn.Server):
    """uvicorn with tokenmill's shutdown: drain on SIGTERM/SIGINT, exit codes that say what happened."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_period_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_period_s = grace_period_s
        self.exit_code = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would close the listener at once (no 503s) and re-raise the signal at exit
        # (exit status -15 instead of 0).
        if self._draining:
            if sig == signal.SIGINT:  # a second Ctrl-C: stop waiting
                self.force_exit = self.should_exit = True
            return
        self._draining = True
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain(signal.Signals(sig).name)))

    async def drain(self, why: str) -> None:
        state, engine = self.state, self.state.engine
        if state.status in ("ready", "loading"):
            state.status, state.status_detail = "draining", "the server is shutting down"
        if engine is None:
            logger.info("received %s before the model was ready; exiting", why)
            self.should_exit = True
            return
        logger.info(
            "received %s: no new requests; %d in flight get up to %.0fs to finish",
            why,
            engine.num_in_flight,
            self.grace_period_s,
        )
        deadline = time.monotonic() + self.grace_period_s
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            n = engine.abort_all(
                f"the server is shutting down and the grace period of {self.grace_period_s:.0f}s has passed"
            )
            logger.warning("grace period over: aborted %d requests", n)
            settle = time.monotonic() + 2.0  # let the handlers write their answers
            while engine.num_in_flight and time.monotonic() < settle:
                await asyncio.sleep(0.05)
        logger.info("drained; shutting down")
        self.should_exit = True

    def exit_soon(self, code: int, delay_s: float = 0.0) -> None:
        self.exit_code = code

        def stop() -> None:
            self.should_exit = True

        if self._loop is not None:
            self._loop.call_later(delay_s, stop)
        else:
            stop()


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """A Hugging Face folder for `model` (a hub model is downloaded, a GGUF converted, on first use, then
    cached). Imports no torch unless a GGUF needs converting (model_files.py)."""
    from tokenmill.engine.model_files import resolve_model

    return str(resolve_model(model, revision))


def load_tokenizer_and_config(path: str, without_torch: bool = True) -> tuple:
    """without_torch: the engine core runs in its own process, so this one need not pay for torch."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.model_files import load_tokenizer

    return load_tokenizer(path, without_torch=without_torch), load_model_config(path)


async def bring_up(
    state: ServerState, args: argparse.Namespace, server: Server, launched: MPClient | None = None
) -> None:
    """Resolve the model, then start the engine core and load the tokenizer side by side (both take
    seconds of imports and loading), then open for requests. Heavy imports run in worker threads: the
    event loop keeps answering /health meanwhile. launched: the engine core serve_cli.py started before
    this process's imports, on the resolved folder (its config says which)."""
    config = engine_config(args) if launched is None else launched.config
    if launched is not None:
        state.extra["client"] = launched  # shut down by the lifespan, whatever happens below
    try:
        if launched is None:
            # Resolve first, once: a first-time GGUF conversion must not run in two processes at once.
            config.model = await asyncio.to_thread(resolve_model_path, args.model, args.revision)
        bundled = parse_model_source(args.model, args.revision).scheme == "bundled"
        defaults, source = default_sampling_params(
            args.generation_config, config.model, bundled, args.override_generation_config
        )
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the default sampling parameters from {source} are invalid: {e}") from None
        client = launched
        if client is None:
            client = InprocClient(config) if args.engine_in_process else MPClient(config, args.log_level.upper())
            state.extra["client"] = client
        info, (tokenizer, model_config) = await asyncio.gather(
            client.start(), asyncio.to_thread(load_tokenizer_and_config, config.model, not args.engine_in_process)
        )
    except Exception as e:
        logger.error("startup failed: %s", e)
        state.status, state.status_detail = "failed", f"startup failed: {e}"
        server.exit_soon(1)
        return
    capacity = info.capacity
    metrics = ServerMetrics(state.model_name, capacity.max_model_len)
    metrics.set_capacity(capacity, config.enable_prefix_caching)

    def on_dead(err: EngineDeadError) -> None:
        state.status, state.status_detail = "dead", f"the engine core failed ({err}); the server is exiting"
        logger.error("engine core died: %s; exiting with status 1", err)
        server.exit_soon(1, DEATH_EXIT_DELAY_S)

    engine = AsyncLLM(
        client,
        tokenizer,
        info,
        max_waiting_requests=args.max_waiting_requests or None,
        metrics=metrics,
        on_dead=on_dead,
    )
    engine.start()
    state.engine, state.metrics, state.tokenizer = engine, metrics, tokenizer
    state.model_root = config.model
    state.vocab_size = min(len(tokenizer), model_config.vocab_size)
    state.max_model_len = capacity.max_model_len
    state.max_num_seqs = capacity.max_num_seqs
    state.default_sampling = defaults
    template = getattr(tokenizer, "chat_template", None)
    state.template_uses_tools = template_uses_tools(template)
    state.tool_call_parser = args.tool_call_parser
    if args.tool_call_parser == "auto":
        hermes = not state.template_uses_tools or "<tool_call>" in str(template)
        state.tool_call_parser = "hermes" if hermes else "none"
    logger.info(
        "tools: %s; tool-call parser: %s",
        "the chat template renders them"
        if state.template_uses_tools
        else "the chat template ignores them: written into the system message (Hermes format)",
        state.tool_call_parser,
    )
    if state.status == "loading":
        state.status, state.status_detail = "ready", "ok"
    logger.info("%s", capacity.describe())
    logger.info("%s", describe(defaults, source))
    since_start = seconds_since_process_start()
    logger.info(
        "ready: serving %s on http://%s:%d (model load %.1fs%s; engine core start-up: %s)",
        ", ".join(state.served_model_names),
        args.host,
        args.port,
        capacity.model_load_seconds,
        "" if since_start is None else f", {since_start:.1f}s after the process started",
        capacity.describe_startup() or "not reported",
    )


def run_server(args: argparse.Namespace, launched: MPClient | None = None) -> int:
    """Serve until shutdown; the exit status. launched: the engine core serve_cli.py launched already."""
    state = ServerState(
        served_model_names=list(args.served_model_name),
        api_key=args.api_key or None,
        require_auth_for_metrics=args.require_auth_for_metrics,
    )
    holder: dict[str, Server] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(bring_up(state, args, holder["server"], launched))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            if state.engine is not None:
                await state.engine.close()
            client = state.extra.get("client")
            if client is not None:
                await asyncio.to_thread(client.shutdown)

    app = build_app(state, lifespan, HealthConfig(args.readiness_stall_seconds, args.liveness_stall_seconds))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # keep the logging set up above
        log_level=args.log_level,
        access_log=not args.disable_access_log,
        timeout_graceful_shutdown=5,  # the drain above already waited; this only bounds idle connections
    )
    server = holder["server"] = Server(config, state, args.shutdown_grace_period)
    server.run()
    return server.exit_code
