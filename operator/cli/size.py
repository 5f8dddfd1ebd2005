"""`tokenmill size`: print the sizing plan the operator would use, before any pod starts."""

import argparse
import json
import sys

import yaml
from tokenmill.engine.kv_memory import KV_CACHE_DTYPES
from tokenmill.operator.plan.catalog import (
    GPU_TYPES,
    MODEL_PROFILES,
    ModelProfile,
    ProfileError,
    find_model_profile,
    profile_from_hf_config,
    profile_from_spec,
)
from tokenmill.operator.plan.sizing import EngineSettings, SizingPlan, gb, plan

FIELD_ORDER = (
    "weights_bytes", "kv_bytes_per_token", "kv_blocks", "kv_tokens", "max_model_len", "max_num_seqs",
    "gpus_per_replica", "feasible", "reason",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenmill size",
        description="Print the KV-memory sizing plan of a model on a GPU type (the operator's own function).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"catalog model or model URI ({', '.join(MODEL_PROFILES)})")
    src.add_argument("--profile", help="YAML/JSON file with spec.model.profile keys (layers, hiddenSize, ...)")
    src.add_argument("--model-config", help="a Hugging Face config.json")
    p.add_argument("--gpu", required=True, choices=sorted(GPU_TYPES), help="GPU type")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per replica (default: the fewest that fit)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the engine's --kv-cache-dtype: auto (= dtype), int8, fp8 (e4m3), fp8_e5m2")
    p.add_argument("--max-model-len", default="auto", help="an integer or auto")
    p.add_argument("--max-num-seqs", default="auto", help="an integer or auto")
    p.add_argument("--block-size", type=int, default=16, choices=[16, 32])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _auto_int(value: str, flag: str) -> int | None:
    if value == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{flag} must be an integer or auto, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{flag} must be at least 1, got {number}")
    return number


def load_profile(args: argparse.Namespace) -> ModelProfile:
    if args.model:
        found = find_model_profile(args.model)
        if found is None:
            raise ProfileError("UnknownModelProfile", f"model {args.model!r} is not in the catalog "
                               f"({', '.join(MODEL_PROFILES)}): pass --profile FILE or --model-config config.json")
        return found
    if args.profile:
        with open(args.profile) as f:
            data = yaml.safe_load(f) or {}
        data = data.get("profile", data)  # a bare profile, or {name, profile: {...}}
        base = data.get("base")
        base_profile = find_model_profile(base) if base else None
        if base and base_profile is None:
            raise ProfileError("UnknownModelProfile", f"profile base {base!r} is not in the catalog")
        fields = {k: v for k, v in data.items() if k not in ("base", "name")}
        return profile_from_spec(fields, base_profile, data.get("name") or args.profile)
    with open(args.model_config) as f:
        return profile_from_hf_config(json.load(f), args.model_config)


def render(p: SizingPlan, profile: ModelProfile) -> str:
    gpu = GPU_TYPES[p.gpu_type]
    usable = p.gpu_memory_bytes * p.gpu_memory_utilization
    rows = [
        ("model", f"{profile.name} ({profile.source}), {profile.num_parameters:,} parameters"),
        ("gpu", f"{p.gpus_per_replica} x {gpu.name} ({gb(gpu.memory_bytes)} each, {gb(usable)} at "
                f"gpu_memory_utilization {p.gpu_memory_utilization:g})"),
        ("layout", f"TP {p.tensor_parallel_size} x PP {p.pipeline_parallel_size}, {p.nodes_per_replica} "
                   f"{'node' if p.nodes_per_replica == 1 else 'nodes (a LeaderWorkerSet group)'} per replica"),
        ("dtype", f"{p.dtype}, KV cache {p.kv_cache_dtype}"),
        ("weights", f"{gb(p.weights_bytes)} ({gb(p.weights_bytes_per_gpu)} per GPU)"),
        ("overhead", f"{gb(p.overhead_bytes)} per GPU (runtime, activations, sampler)"),
        ("kv cache", f"{gb(p.kv_cache_bytes)} per GPU, {p.kv_bytes_per_token} bytes/token per GPU"),
        ("kv blocks", f"{p.kv_blocks} x {p.block_size} = {p.kv_tokens} tokens per replica"),
        ("max_model_len", f"{p.max_model_len} (model supports {p.max_position_embeddings})"),
        ("max_num_seqs", str(p.max_num_seqs)),
        ("target queue", f"{p.target_queue_depth} waiting+running requests per replica"),
        ("host memory", f"{gb(p.host_memory_bytes)} per pod at the weights' load peak (API server + "
                        f"{p.tensor_parallel_size} x (process + largest tensor in fp32 + margin)); the pod "
                        "requests at least this"),
        ("feasible", f"{'yes' if p.feasible else 'no'} ({p.reason})"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if p.message:
        lines.append("")
        lines.append(p.message)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        settings = EngineSettings(
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            max_model_len=_auto_int(args.max_model_len, "--max-model-len"),
            max_num_seqs=_auto_int(args.max_num_seqs, "--max-num-seqs"),
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
        if args.gpus is not None and args.gpus < 1:
            raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
        profile = load_profile(args)
        result = plan(profile, GPU_TYPES[args.gpu], settings, args.gpus)
    except (ValueError, OSError) as e:  # ProfileError is a ValueError
        print(f"tokenmill size: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        ordered = {k: out.pop(k) for k in FIELD_ORDER}
        print(json.dumps({**ordered, **out, "profile_source": profile.source}, indent=2))
    else:
        print(render(result, profile))
    return 0 if result.feasible else 1
