"""The running `tokenmill serve`: the bring-up of the engine behind the HTTP server, then uvicorn until
shutdown (uvicorn_server.py drains it).

cli/serve.py parses the flags, builds the EngineConfig and may have launched the engine core already,
before this module's imports (uvicorn, FastAPI, the API routes: about a second here), which then overlap
the core's.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI
from tokenmill.engine.config import EngineConfig, max_cpu_loras
from tokenmill.engine.core.client import EngineDeadError, InprocClient, MPClient
from tokenmill.engine.frontend.async_llm import AsyncLLM
from tokenmill.engine.frontend.generation_config import default_sampling_params, describe
from tokenmill.engine.model.source import parse_model_source
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.app import build_app
from tokenmill.engine.server.errors import OpenAIError
from tokenmill.engine.server.health import HealthConfig
from tokenmill.engine.server.lora import LoRAServing, read_lora_modules_file
from tokenmill.engine.server.prometheus import ServerMetrics
from tokenmill.engine.server.state import ServerState
from tokenmill.engine.server.tools.request import template_uses_tools
from tokenmill.engine.server.uvicorn_server import Server

logger = logging.getLogger("tokenmill.serve")

DEATH_EXIT_DELAY_S = 1.0  # lets the 500s of failed requests reach their clients before the process exits


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc; None elsewhere): what the ready line reports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """A Hugging Face folder for `model` (a hub model is downloaded, a GGUF converted, on first use, then
    cached). Imports no torch unless a GGUF needs converting (model/resolve.py)."""
    from tokenmill.engine.model.resolve import resolve_model

    return str(resolve_model(model, revision))


def load_tokenizer_and_config(path: str, without_torch: bool = True) -> tuple:
    """without_torch: the engine core runs in its own process, so this one need not pay for torch."""
    from tokenmill.engine.model.tokenizer import load_tokenizer
    from tokenmill.engine.model_config import load_model_config

    return load_tokenizer(path, without_torch=without_torch), load_model_config(path)


async def bring_up(
    state: ServerState, args: argparse.Namespace, config: EngineConfig, server: Server,
    launched: MPClient | None = None,
) -> None:
    """Resolve the model, then start the engine core and load the tokenizer side by side (both take
    seconds of imports and loading), then open for requests. Heavy imports run in worker threads: the
    event loop keeps answering /health meanwhile. launched: the engine core cli/serve.py started before
    this process's imports, on the resolved folder (its config says which)."""
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

    lora = None
    if config.enable_lora:
        try:
            lora = await register_lora_modules(args, config, model_config, state)
        except Exception as e:
            logger.error("startup failed: %s", e)
            state.status, state.status_detail = "failed", f"startup failed: {e}"
            server.exit_soon(1)
            return
        metrics.enable_lora(config.max_loras)
        metrics.set_lora_adapters(list(lora.adapters), lora.failed)
    engine = AsyncLLM(
        client,
        tokenizer,
        info,
        max_waiting_requests=args.max_waiting_requests or None,
        max_cpu_loras=max_cpu_loras(config),
        metrics=metrics,
        on_dead=on_dead,
    )
    engine.start()
    state.engine, state.metrics, state.tokenizer, state.lora = engine, metrics, tokenizer, lora
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
    if lora is not None and args.lora_modules_file:
        state.extra["lora_file_task"] = asyncio.get_running_loop().create_task(watch_lora_modules_file(state, args))
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


async def register_lora_modules(
    args: argparse.Namespace, config: EngineConfig, model_config: object, state: ServerState
) -> LoRAServing:
    """The server's adapters, --lora-modules checked and registered (downloads in a thread); any that
    fails fails the start-up, with the reason."""
    lora = LoRAServing(
        state.model_name, model_config, config.max_loras, config.max_lora_rank, max_cpu_loras(config),
        args.allow_runtime_lora_updating,
    )  # fmt: skip
    for module in args.lora_modules:
        try:
            added = await asyncio.to_thread(lora.load, module.name, module.path, set(state.served_model_names))
        except OpenAIError as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e.message}") from None
        logger.info("LoRA adapter %r (id %d) from %s", added.lora_name, added.lora_int_id, added.lora_path)
    if args.lora_modules_file:  # before the server is ready: the adapters it lists are served from the start
        await sync_lora_modules_file(lora, args.lora_modules_file, set(state.served_model_names), retry=False)
    logger.info("LoRA: %d adapters registered; %d slots of rank %d, %d in host memory; runtime loading %s",
                len(lora.adapters), config.max_loras, config.max_lora_rank, max_cpu_loras(config),
                "on" if lora.allow_runtime_updates else "off (--allow-runtime-lora-updating)")  # fmt: skip
    return lora


LORA_FILE_POLL_S = 2.0  # how often --lora-modules-file is looked at (a stat; read only when it changed)
LORA_RETRY_S = 30.0  # how often adapters that failed to load are tried again


async def sync_lora_modules_file(lora: LoRAServing, path: str, reserved: set[str], retry: bool) -> bool:
    """One pass over --lora-modules-file; a file that is missing or not valid is logged and changes nothing."""
    try:
        modules = await asyncio.to_thread(read_lora_modules_file, path)
    except (OSError, ValueError) as e:
        logger.error("--lora-modules-file %s: %s; adapters unchanged", path, e)
        return False
    changed = await asyncio.to_thread(lora.sync_file, modules, reserved, retry)
    if changed:
        for name, reason in lora.failed.items():
            logger.error("LoRA adapter %r from %s failed to load: %s", name, path, reason)
        logger.info("LoRA adapters from %s: %s", path, ", ".join(sorted(lora.from_file)) or "none")
    return changed


async def watch_lora_modules_file(state: ServerState, args: argparse.Namespace) -> None:
    """Follow --lora-modules-file: the kubelet rewrites a mounted ConfigMap when it changes (by swapping a
    symlink, so the path's stat changes)."""
    path, last, last_retry = args.lora_modules_file, None, time.monotonic()
    while True:
        await asyncio.sleep(LORA_FILE_POLL_S)
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        retry = bool(state.lora.failed) and time.monotonic() - last_retry >= LORA_RETRY_S
        if key == last and not retry:
            continue
        last = key
        if retry:
            last_retry = time.monotonic()
        if await sync_lora_modules_file(state.lora, path, set(state.served_model_names), retry):
            state.metrics.set_lora_adapters(list(state.lora.adapters), state.lora.failed)


def run_server(args: argparse.Namespace, config: EngineConfig, launched: MPClient | None = None) -> int:
    """Serve until shutdown; the exit status. config: the engine's (from the flags); launched: the engine
    core cli/serve.py launched already, on the resolved folder."""
    state = ServerState(
        served_model_names=list(args.served_model_name),
        api_key=args.api_key or None,
        require_auth_for_metrics=args.require_auth_for_metrics,
        max_request_body_bytes=args.max_request_body_bytes,
    )
    holder: dict[str, Server] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(bring_up(state, args, config, holder["server"], launched))
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
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # keep the logging set up above
        log_level=args.log_level,
        access_log=not args.disable_access_log,
        timeout_graceful_shutdown=5,  # the drain above already waited; this only bounds idle connections
    )
    server = holder["server"] = Server(uv_config, state, args.shutdown_grace_period)
    server.run()
    return server.exit_code
