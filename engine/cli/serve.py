"""`tokenmill serve`: the OpenAI-compatible server.

Every flag can also come from the environment as TOKENMILL_<FLAG> (e.g. TOKENMILL_API_KEY,
TOKENMILL_MAX_NUM_SEQS); a flag on the command line wins over the environment.

Lifecycle: HTTP comes up at once (/health answers 503 while the model loads); the engine core starts
in a child process (before the web stack's imports when the model needs no download or conversion:
server/launch.py) and reports its capacity, which is logged; SIGTERM (what Kubernetes sends) stops
admission (503), lets in-flight requests finish within --shutdown-grace-period, aborts the rest and
exits 0. If the engine core dies, in-flight requests fail with 500, /health turns 503 and the
process exits 1 so that Kubernetes restarts the pod. If it stops making progress with requests in it,
/health turns 503 after --readiness-stall-seconds and /live after --liveness-stall-seconds (health.py).
"""

import argparse
import logging
import os
import re

from tokenmill.engine.config import (
    DEFAULT_LIVENESS_STALL_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_READINESS_STALL_S,
    DEFAULTS,
    EngineConfig,
    kv_events_dict,
    parse_kv_events_config,
)
from tokenmill.engine.frontend.generation_config import parse_override
from tokenmill.engine.kv_memory import KV_CACHE_DTYPES
from tokenmill.engine.model.bundled import BUNDLED_MODEL
from tokenmill.engine.model.source import ModelSourceError, parse_model_source
from tokenmill.engine.server.tools.parser import PARSERS

logger = logging.getLogger("tokenmill.serve")

ENV_PREFIX = "TOKENMILL_"
DEFAULT_MODEL_NAME = BUNDLED_MODEL  # the bundled model, as the operator's bundled:// URI names it

_SIZE = re.compile(r"^\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9', '1073741824' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (examples: 2GiB, 512MiB, 1e9)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenmill serve",
        description="OpenAI-compatible server. Every flag can also be set as TOKENMILL_<FLAG>, "
        "e.g. TOKENMILL_API_KEY or TOKENMILL_MAX_NUM_SEQS.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="hf://ORG/NAME[@REVISION], ORG/NAME, pvc://CLAIM/PATH, file:///PATH, bundled://smollm2-135m-instruct, "
        "or a local HF folder or GGUF file; default: the bundled SmolLM2-135M-Instruct",
    )
    p.add_argument("--revision", default=None, help="hub models: branch, tag or commit sha (default: main)")
    p.add_argument(
        "--check",
        action="store_true",
        help="run every check the engine makes before loading weights (fetching config.json only), print "
        "one line and exit: 0 if the engine would start, 2 if not",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in `model`; the first is reported (default: --model, or "
        f"{DEFAULT_MODEL_NAME})",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize"
    )
    p.add_argument(
        "--require-auth-for-metrics",
        action="store_true",
        help="also require the API key on /metrics (open by default for Prometheus)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=_non_negative_int,
        default=256,
        help="answer 429 when this many admitted requests wait to be scheduled; 0: no limit",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="answer 413 to a request body larger than this, declared or chunked "
        f"(default {DEFAULT_MAX_REQUEST_BODY_BYTES // 2**20}MiB)",
    )
    p.add_argument("--max-num-seqs", type=_positive_int, default=DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=DEFAULTS.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--block-size", type=_positive_int, default=16)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=_positive_int, default=None)
    kv.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=None, help="bytes for the KV cache, e.g. 2GiB"
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default=DEFAULTS.kv_cache_dtype,
        help="KV cache dtype: auto (the model's), int8 or fp8 (= fp8_e4m3) / fp8_e5m2: 8-bit codes with a scale "
        "per token and head, about half the bytes of bf16 (docs/engine.md, '8-bit KV cache')",
    )
    p.add_argument(
        "--int8-activations",
        action="store_true",
        help="CPU, fp32 on integer-code weights (a Q4_0/Q4_1/Q8_0 GGUF): round activations to int8 per 32 "
        "values as llama.cpp does; faster decode, no longer bit-exact (docs/engine.md, 'int8 activations')",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shutdown-grace-period",
        type=_seconds,
        default=25.0,
        help="seconds in-flight requests get to finish after SIGTERM (Kubernetes kills at 30 by default)",
    )
    p.add_argument(
        "--readiness-stall-seconds",
        type=_seconds,
        default=DEFAULT_READINESS_STALL_S,
        help="/health answers 503 once the engine core has had requests but made no step for this long "
        "(keep it above the longest step: a full --max-num-batched-tokens prefill)",
    )
    p.add_argument(
        "--liveness-stall-seconds",
        type=_seconds,
        default=DEFAULT_LIVENESS_STALL_S,
        help="/live answers 503 (the pod gets restarted) once the stall lasts this long; at least "
        "--readiness-stall-seconds",
    )
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core in a thread of this process instead of a child process (debugging)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--disable-access-log", action="store_true")
    # Parallelism (docs/engine.md, "Tensor and pipeline parallel"). Multi-node defaults come from the
    # LeaderWorkerSet env (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS).
    p.add_argument(
        "--tensor-parallel-size", type=_positive_int, default=1, help="ranks (GPUs) each layer is split over"
    )
    p.add_argument(
        "--pipeline-parallel-size", type=_positive_int, default=1, help="stages the layers are split into"
    )
    p.add_argument(
        "--nnodes", type=_positive_int, default=None, help="nodes of one replica (default: LWS_GROUP_SIZE, or 1)"
    )
    p.add_argument(
        "--node-rank", type=_non_negative_int, default=None, help="this node's index (default: LWS_WORKER_INDEX, or 0)"
    )
    p.add_argument(
        "--leader-address", default=None, help="headless workers: the leader's host (default: LWS_LEADER_ADDRESS)"
    )
    p.add_argument(
        "--dist-port", type=_port, default=0, help="leader's rendezvous port; 0: a free one (one node) or 29500"
    )
    p.add_argument(
        "--collective-timeout",
        type=_seconds,
        default=DEFAULTS.collective_timeout_s,
        help="seconds a step waits on another rank before the engine declares it hung and exits",
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="multi-node worker: start this node's ranks for the leader's engine, serve no HTTP",
    )
    p.add_argument(
        "--generation-config",
        default=None,
        help="default sampling for requests that leave it out: auto (the model's generation_config.json; "
        "for the bundled model its card's temperature 0.2, top_p 0.9), vllm (the engine's: temperature 1), "
        "or a folder holding a generation_config.json. Unset: auto, except that the bundled model decodes "
        "greedily (temperature 0), which answers README's question right every time (docs/serving.md)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default="auto",
        help="how tool calls are read from the model's text: auto (hermes when the chat template writes "
        "<tool_call> blocks or ignores tools, which then go into the system prompt in that format; else "
        "none), hermes, or none (tool_choice 'auto' is refused; 'required' and named calls still work)",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        help='JSON laid over the generation config, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\'',
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: do not capture decode steps as CUDA graphs"
    )
    # LoRA adapters (vLLM's flags; docs/serving.md, "LoRA adapters")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders) on the base model")
    p.add_argument("--max-loras", type=_positive_int, default=DEFAULTS.max_loras,
                   help="adapters one step can run (the slots every rank holds)")  # fmt: skip
    p.add_argument("--max-lora-rank", type=_positive_int, default=DEFAULTS.max_lora_rank,
                   help="largest adapter rank served (every slot holds this rank)")  # fmt: skip
    p.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help="adapters kept in host memory, and with requests in flight at once (default: --max-loras)")  # fmt: skip
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help='adapters to serve from the start: NAME=PATH or \'{"name": NAME, "path": PATH}\' (PATH: a folder, '
        "hf://ORG/NAME[@REV], pvc://CLAIM/PATH or file:///PATH); implies --enable-lora",
    )
    p.add_argument(
        "--lora-modules-file",
        default=None,
        help='a JSON list of {"name": NAME, "path": PATH} read before the server is ready and again whenever '
        "it changes: adapters added, changed and removed without a restart (the operator mounts its ConfigMap "
        "here); one that fails to load is reported in tokenmill:lora_adapter_info and does not stop the server; "
        "implies --enable-lora",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true does the same)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV-cache events as JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
        "\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv@POD@MODEL\"}' (also replay_endpoint, buffer_steps, "
        "hwm, max_queue_size): BlockStored / BlockRemoved / AllBlocksCleared over ZeroMQ for KV-aware "
        "routers such as llm-d's (docs/serving.md)",
    )
    return p


def _env_value(action: argparse.Action, raw: str, env_name: str) -> object:
    if action.nargs == 0:  # store_true and --x/--no-x flags
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{env_name}={raw!r}: expected true or false")
    convert = action.type or str
    if action.nargs in ("+", "*"):
        return [convert(v) for v in re.split(r"[,\s]+", raw.strip()) if v]
    value = convert(raw)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{env_name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value


def parse_args(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Command line over environment over defaults."""
    parser = build_parser()
    env = os.environ if environ is None else environ
    defaults = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = ENV_PREFIX + action.dest.upper()
        if name in env:
            try:
                defaults[action.dest] = _env_value(action, env[name], name)
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{name}: {e}")
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if args.num_kv_blocks is not None and args.kv_cache_memory is not None:
        parser.error("give --num-kv-blocks or --kv-cache-memory, not both (also via TOKENMILL_*)")
    if args.liveness_stall_seconds < args.readiness_stall_seconds:
        parser.error(
            f"--liveness-stall-seconds ({args.liveness_stall_seconds:g}) must be at least "
            f"--readiness-stall-seconds ({args.readiness_stall_seconds:g}): a stall takes the pod out of the "
            "Service before it restarts it"
        )
    try:
        source = parse_model_source(args.model, args.revision)
        args.override_generation_config = parse_override(args.override_generation_config)
        args.kv_events_config = parse_kv_events_config(args.kv_events_config)
    except (ModelSourceError, ValueError) as e:
        parser.error(str(e))
    _resolve_nodes(args, env, parser)
    _resolve_lora(args, env, parser)
    if args.served_model_name is None:
        args.served_model_name = [source.default_served_name]
    return args


def _resolve_nodes(args: argparse.Namespace, env: dict[str, str], parser: argparse.ArgumentParser) -> None:
    """--nnodes / --node-rank / --leader-address from the LeaderWorkerSet env when not given."""
    for dest, name in (("nnodes", "LWS_GROUP_SIZE"), ("node_rank", "LWS_WORKER_INDEX")):
        if getattr(args, dest) is None:
            raw = env.get(name, "")
            try:
                setattr(args, dest, int(raw) if raw else (1 if dest == "nnodes" else 0))
            except ValueError:
                parser.error(f"{name}={raw!r}: expected an integer")
    if args.leader_address is None:
        args.leader_address = env.get("LWS_LEADER_ADDRESS") or None
    from tokenmill.engine.parallel_check import check_parallel_shape  # the engine's own rule, torch-free

    try:
        check_parallel_shape(args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes)
    except ValueError as e:
        parser.error(str(e))
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"node rank {args.node_rank} is outside the {args.nnodes} nodes of this replica")
    if args.headless and (args.node_rank == 0 or not args.leader_address):
        parser.error(
            "--headless runs a worker node: it needs a node rank of 1 or more (--node-rank / LWS_WORKER_INDEX) "
            "and the leader's address (--leader-address / LWS_LEADER_ADDRESS)"
        )
    if not args.headless and args.node_rank != 0:
        parser.error(f"node rank {args.node_rank} is a worker node: run `tokenmill serve --headless` there")


def _resolve_lora(args: argparse.Namespace, env: dict[str, str], parser: argparse.ArgumentParser) -> None:
    """--lora-modules parsed (and implying --enable-lora); the LoRA limits checked as the engine would."""
    from tokenmill.engine.config import check_engine_config
    from tokenmill.engine.server.lora import parse_lora_module, runtime_updates_allowed

    try:
        args.lora_modules = [parse_lora_module(m) for m in args.lora_modules or []]
    except ValueError as e:
        parser.error(str(e))
    names = [m.name for m in args.lora_modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        parser.error(f"--lora-modules names {', '.join(dup)} more than once")
    args.enable_lora = args.enable_lora or bool(args.lora_modules) or bool(args.lora_modules_file)
    args.allow_runtime_lora_updating = runtime_updates_allowed(args.allow_runtime_lora_updating, env)
    if args.allow_runtime_lora_updating and not args.enable_lora:
        parser.error("--allow-runtime-lora-updating needs --enable-lora")
    try:
        check_engine_config(engine_config(args))
    except ValueError as e:
        parser.error(str(e))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        int8_activations=args.int8_activations,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        dist_port=args.dist_port,
        collective_timeout_s=args.collective_timeout,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        kv_events_config=kv_events_dict(args.kv_events_config),
    )


def launch_engine_early(args: argparse.Namespace) -> object | None:
    """The engine core's process, started now when the model's folder is already at hand (a local
    folder, a converted GGUF): its imports and weight load then overlap this process's. None when the
    model needs a download or a conversion first (bring-up does that while /health says loading), or
    when the engine runs in this process."""
    if args.engine_in_process:
        return None
    from tokenmill.engine.model.resolve import resolve_model_if_ready

    folder = resolve_model_if_ready(args.model, args.revision)
    if folder is None:
        return None
    from tokenmill.engine.core.client import MPClient

    config = engine_config(args)
    config.model = str(folder)
    client = MPClient(config, args.log_level.upper())
    client.launch()
    return client


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.check:
        from tokenmill.engine.core.preflight import run_check

        return run_check(engine_config(args), args.revision)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.headless:  # a worker node of a multi-node replica: its ranks only, no HTTP
        from tokenmill.engine.executor.headless import run_headless
        from tokenmill.engine.executor.multiproc import DEFAULT_DIST_PORT

        port = args.dist_port or DEFAULT_DIST_PORT
        return run_headless(engine_config(args), args.node_rank, args.leader_address, port)
    client = launch_engine_early(args)
    try:
        from tokenmill.engine.server.launch import run_server

        return run_server(args, client.config if client is not None else engine_config(args), client)
    finally:
        if client is not None:
            client.shutdown()  # a no-op after the server's own shutdown; not so if it failed to start
