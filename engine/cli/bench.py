"""`tokenmill bench throughput|serve|compare|roofline|structured|lora|output-path|peers|sampler|startup|attention|kv-cache`."""

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from tokenmill.engine.bench.datasets import check_vocab, load_requests, tokenize_requests
from tokenmill.engine.kv_memory import KV_CACHE_DTYPES


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine default when omitted")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto (the model's dtype), int8, fp8 (= fp8_e4m3), fp8_e5m2 (`bench kv-cache` compares them)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--int8-activations", action="store_true",
                   help="integer-code weights (fp32, or bf16 on AVX-512 VNNI): activations rounded to int8 per 32 (serve's flag)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own choice, which honours OMP_NUM_THREADS)")


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help="FILE.jsonl, random:N:IN:OUT, seed-sim or seed-sim:N")
    p.add_argument("--seed", type=int, default=0, help="seed for random:N:IN:OUT and arrivals")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill bench", description="benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("throughput", help="offline throughput through the engine")
    _common_args(p)
    _engine_args(p)
    p.add_argument("--static-batching", action="store_true",
                   help="also run the workload with static batching semantics on the same engine")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("serve", help="online benchmark against an OpenAI-compatible server")
    _common_args(p)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--slo", default=None, help="goodput limits in ms, e.g. ttft:1000,tpot:100")
    p.add_argument("--num-requests", type=int, default=None, help="use the first N requests of the dataset")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("compare", help="tokenmill against Hugging Face baselines, same process")
    _common_args(p)
    _engine_args(p)
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--naive-requests", type=int, default=16, help="subset size for the naive baseline")
    p.add_argument("--static-requests", type=int, default=64, help="subset size for static batching")
    p.add_argument("--hf-cb-requests", type=int, default=64, help="subset size for HF continuous batching")
    p.add_argument("--skip", default="", help="comma list of baselines to skip: naive,static,hf-cb")
    p.add_argument("--plot", default=None, help="write a PNG of throughput and completion times")

    p = sub.add_parser("roofline", help="machine FLOP/s and bandwidth, and the engine decode step's fraction")
    _engine_args(p)
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes to measure")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence (sets the context)")
    p.add_argument("--profile", default=None, help="write a torch.profiler op table of decode at the largest batch")
    p.add_argument("--json", dest="json_out", default=None)

    p = sub.add_parser("structured", help="throughput with a JSON schema on every request vs none")
    _engine_args(p)
    p.add_argument("--batches", default="1,64", help="batch sizes to measure")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--schema-properties", type=int, default=200, help="size of the large schema compiled")
    p.add_argument("--json", dest="json_out", default=None)

    p = sub.add_parser("lora", help="output tokens/s with the batch spread over LoRA adapters vs the base model alone")
    _engine_args(p)
    p.add_argument("--batches", default="8,64", help="batch sizes to measure")
    p.add_argument("--num-adapters", type=int, default=4, help="random adapters written when --adapters is not given")
    p.add_argument("--adapters", default=None, help="comma-separated PEFT adapter folders to use instead")
    p.add_argument("--max-lora-rank", type=int, default=16, help="slot rank; also the random adapters' rank")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="interleaved base / LoRA runs per batch size (best kept)")
    p.add_argument("--json", dest="json_out", default=None)

    p = sub.add_parser("output-path", help="API-process CPU per token: detokenize, stop strings, SSE framing")
    p.add_argument("--model", default=None, help="model folder or GGUF whose tokenizer to use")
    p.add_argument("--batch", type=int, default=64, help="concurrent requests")
    p.add_argument("--tokens", type=int, default=512, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each kind is kept")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--no-sse", action="store_true", help="measure the OutputProcessor alone")
    p.add_argument("--json", dest="json_out", default=None)

    p = sub.add_parser("sampler", help="sampler CPU time per step: the top-K path vs the full sort")
    p.add_argument("--batches", default="1,8,64", help="batch sizes to measure")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (the bundled model's by default)")
    p.add_argument("--scale", type=float, default=3.0, help="standard deviation of the random logits")
    p.add_argument("--steps", type=int, default=5, help="sampler calls per timed round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each kind is kept")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--json", dest="json_out", default=None)

    p = sub.add_parser("attention", help="CPU decode attention over a model-sized KV pool: normal vs huge pages")
    p.add_argument("--batch", type=int, default=64, help="sequences, one query row each")
    p.add_argument("--context", type=int, default=176, help="tokens in each sequence's cache")
    p.add_argument("--layers", type=int, default=30, help="pools of separate blocks, one per layer")
    p.add_argument("--placement", choices=["scattered", "contiguous"], default="scattered",
                   help="blocks in random order over the pool (a server after churn) or in order (a fresh pool)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best of each kind is kept")
    p.add_argument("--kv-cache-dtypes", default="bfloat16",
                   help="comma list: the first runs on normal and huge pages, the others (int8, fp8_e4m3, fp8_e5m2) "
                   "on huge pages against it")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--json", dest="json_out", default=None)

    p = sub.add_parser("kv-cache", help="8-bit KV caches against the model's dtype: blocks for the same memory, "
                       "greedy logprob parity, decode step time")
    _engine_args(p)
    p.add_argument("--kv-cache-dtypes", default="auto,int8,fp8", help="comma list; the first is the baseline")
    p.add_argument("--batches", default="8,64", help="decode batch sizes to time")
    p.add_argument("--prompt-lens", default="128", help="prompt lengths (context) to time, comma list")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is kept")
    p.add_argument("--parity-tokens", type=int, default=64, help="greedy tokens per parity prompt")
    p.add_argument("--json", dest="json_out", default=None)

    p = sub.add_parser("startup", help="time to ready of `tokenmill serve` (/health 200), several starts, with "
                       "the engine core's start-up phases")
    p.add_argument("--runs", type=int, default=3, help="starts measured")
    p.add_argument("--discard-first", action="store_true", help="one more start first, not counted (a cold cache)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags for `tokenmill serve`")

    p = sub.add_parser("peers", help="tokenmill vs vLLM (CPU) vs llama.cpp, same model and client, one table")
    p.add_argument("--engines", default="tokenmill,vllm,llama.cpp", help="comma list, run in this order")
    p.add_argument("--concurrency", default="1,8,64", help="comma list of --max-concurrency values")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run (at least 2 x concurrency)")
    p.add_argument("--out", default="bench-out/peers", help="folder for the JSON, the table and the plot")
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--workloads", default="random,prefix", help="comma list of random, prefix")
    p.add_argument("--clients", default="vllm,tokenmill", help="comma list of vllm, tokenmill (bench serve)")
    p.add_argument("--models", default="bundled,dense-bf16",
                   help="comma list, each run by every engine: bundled (the Q4_1 GGUF; vLLM serves its weights "
                   "dequantized), dense-bf16 (a 362M Llama stored in bf16, written once), or a path to a GGUF "
                   "file or a Hugging Face folder (llama.cpp serves GGUF files only)")  # fmt: skip
    return parser


def _set_threads(threads: int | None) -> int:
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    n = torch.get_num_threads()
    print(f"torch threads: {n}", file=sys.stderr)
    return n


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "block_size": args.block_size,
        "enable_prefix_caching": not args.no_prefix_caching,
        "int8_activations": args.int8_activations,
    }
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory", "kv_cache_dtype"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return kw


def _build_llm(args: argparse.Namespace) -> Any:
    from tokenmill.engine import LLM

    return LLM(**_llm_kwargs(args))


def resolved_dtype(llm: Any) -> str:
    """The dtype the engine actually runs ("auto" resolved)."""
    return str(llm.capacity.dtype).removeprefix("torch.")


def _model_dir(model: str | None) -> str:
    from tokenmill.engine.model.resolve import resolve_model

    return str(resolve_model(model))


def _load_tokenizer(model_dir: str) -> Any:
    from tokenmill.engine.model.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


def _prepare_requests(args: argparse.Namespace, model_dir: str) -> list:
    requests = load_requests(args.dataset, seed=args.seed)
    if any(r.prompt_token_ids is None for r in requests):
        tokenize_requests(requests, _load_tokenizer(model_dir))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    check_vocab(requests, int(cfg["vocab_size"]))
    return requests


def _emit(result: dict[str, Any], json_out: str | None) -> None:
    # Other jobs share this machine; the load average says how much to trust the absolute numbers.
    result["host"] = {"cpus": os.cpu_count(), "loadavg_1_5_15m": [round(x, 2) for x in os.getloadavg()]}
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if json_out:
        with open(json_out, "w") as f:
            f.write(text + "\n")


def cmd_throughput(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.throughput import run_engine, run_static_on_engine, throughput_report, warm_up

    threads = _set_threads(args.threads)
    requests = _prepare_requests(args, _model_dir(args.model))
    llm = _build_llm(args)
    warm_up(llm)
    cpu0 = time.process_time()
    seconds, _, _ = run_engine(llm, requests, use_tqdm=not args.no_progress)
    cpu_seconds = time.process_time() - cpu0
    stats = llm.stats()
    max_num_seqs = int(stats["max_num_seqs"])
    report = throughput_report(requests, seconds, stats, resolved_dtype(llm), max_num_seqs)
    report["threads"] = threads
    # CPU time moves little when other jobs share the cores (see compare.py); wall time is the headline.
    report["cpu_seconds"] = cpu_seconds
    report["tokens_per_cpu_s"] = report["generated_tokens"] / cpu_seconds
    if args.static_batching:
        # The static run takes longer; show the continuous-batching result first.
        print(json.dumps({k: report[k] for k in ("seconds", "tokens_per_s", "num_steps", "slot_occupancy",
                                                 "kv_utilization")}), file=sys.stderr, flush=True)
        report["static_batching"] = run_static_on_engine(llm, requests, max_num_seqs,
                                                         use_tqdm=not args.no_progress)
    _emit(report, args.json_out)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.serve import run_serve_benchmark
    from tokenmill.engine.bench.serve_stats import parse_slo

    slo = parse_slo(args.slo) if args.slo else None
    requests = load_requests(args.dataset, seed=args.seed)
    if args.num_requests is not None:
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
        requests = requests[: args.num_requests]
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    import httpx

    try:
        result = asyncio.run(run_serve_benchmark(
            args.base_url, args.model, requests, request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, slo=slo, seed=args.seed, timeout_s=args.timeout,
            progress=not args.no_progress,
        ))
    except httpx.HTTPError as e:  # only the /v1/models lookup raises; request failures are counted
        print(f"tokenmill bench serve: cannot list models at {args.base_url}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    _emit(result, args.json_out)
    return 0 if result["failed"] == 0 else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.compare import run_compare

    _set_threads(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {"naive", "static", "hf-cb"}
    if unknown:
        raise ValueError(f"--skip: unknown baseline(s) {sorted(unknown)}; choose from naive, static, hf-cb")
    for name in ("static_batch", "naive_requests", "static_requests", "hf_cb_requests"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    model_dir = _model_dir(args.model)
    requests = _prepare_requests(args, model_dir)

    # One dtype for every system: the engine resolves "auto", then transformers gets the same.
    llm = _build_llm(args)
    dtype = resolved_dtype(llm)
    max_num_seqs = int(llm.stats()["max_num_seqs"])
    max_batched = args.max_num_batched_tokens or _engine_default("max_num_batched_tokens")
    report = run_compare(
        llm, model_dir, dtype, requests, max_num_seqs, args.block_size, max_batched, args.static_batch,
        {"naive": args.naive_requests, "static": args.static_requests, "hf-cb": args.hf_cb_requests},
        _pad_token_id(model_dir), args.plot, skip,
    )
    _emit(report, args.json_out)
    return 0


def _engine_default(name: str) -> Any:
    from tokenmill.engine.config import EngineConfig

    return getattr(EngineConfig(), name)


def _pad_token_id(model_dir: str) -> int:
    tok = _load_tokenizer(model_dir)
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)


def cmd_roofline(args: argparse.Namespace) -> int:
    import torch
    from tokenmill.engine.bench import roofline

    threads = _set_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches must list positive batch sizes, got {args.batches!r}")
    machine = {
        "threads": threads,
        "matmul_gflops_float32": roofline.matmul_flops(torch.float32) / 1e9,
        "matmul_gflops_bfloat16": roofline.matmul_flops(torch.bfloat16) / 1e9,
        "copy_gbytes_per_s": roofline.copy_bandwidth() / 1e9,
    }
    print(json.dumps(machine), file=sys.stderr)
    model_dir = _model_dir(args.model)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batches)
    llm = _build_llm(args)
    dtype = resolved_dtype(llm)
    shape = roofline.model_shape(model_dir, dtype)
    peak = machine[f"matmul_gflops_{dtype}"] * 1e9 if f"matmul_gflops_{dtype}" in machine else \
        roofline.matmul_flops(roofline.DTYPES[dtype]) * 1e9
    steps = []
    for b in batches:
        seconds, context = roofline.measure_decode_step(llm, b, prompt_len=args.prompt_len)
        flops, nbytes = roofline.decode_step_cost(shape, b, context, dtype)
        row = {"batch": b, "mean_context": context, "tokens_per_s": b / seconds}
        row.update(roofline.roofline_fraction(flops, nbytes, seconds, peak, machine["copy_gbytes_per_s"] * 1e9))
        steps.append(row)
        print(json.dumps(row), file=sys.stderr)
    if args.profile:
        roofline.profile_decode(llm, max(batches), args.profile, prompt_len=args.prompt_len)
        print(f"profile written to {args.profile}", file=sys.stderr)
    _emit({"machine": machine, "model": shape, "dtype": dtype, "decode_steps": steps}, args.json_out)
    return 0


def cmd_structured(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.structured import run_structured_bench

    threads = _set_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches must list positive batch sizes, got {args.batches!r}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batches)
    llm = _build_llm(args)
    report = run_structured_bench(llm, batches, args.max_tokens, args.schema_properties)
    report.update({"threads": threads, "dtype": resolved_dtype(llm)})
    _emit(report, args.json_out)
    return 0


def cmd_lora(args: argparse.Namespace) -> int:
    from tokenmill.engine import LLM
    from tokenmill.engine.bench.lora import run_lora_bench

    threads = _set_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches must list positive batch sizes, got {args.batches!r}")
    for name in ("num_adapters", "max_tokens", "prompt_len", "rounds", "max_lora_rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    adapters = [Path(p) for p in args.adapters.split(",") if p.strip()] if args.adapters else None
    num = len(adapters) if adapters else args.num_adapters
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batches)
    llm = LLM(**_llm_kwargs(args), enable_lora=True, max_loras=num, max_lora_rank=args.max_lora_rank)
    report = run_lora_bench(llm, adapters, num, args.max_lora_rank, batches, args.max_tokens, args.prompt_len,
                            args.rounds)  # fmt: skip
    report.update({"threads": threads, "dtype": resolved_dtype(llm)})
    _emit(report, args.json_out)
    return 0


def cmd_output_path(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.output_path import run_output_path_bench

    for name in ("batch", "tokens", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    tokenizer = _load_tokenizer(_model_dir(args.model))
    report = run_output_path_bench(tokenizer, args.batch, args.tokens, args.rounds, args.stop, not args.no_sse)
    _emit(report, args.json_out)
    return 0


def cmd_sampler(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.sampler import run_sampler_bench

    _set_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches must list positive batch sizes, got {args.batches!r}")
    for name in ("vocab", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    report = run_sampler_bench(batches, args.vocab, args.scale, args.steps, args.rounds)
    for row in report["rows"]:
        print(f"batch {row['batch']:>3} {row['case']:<22} full sort {row['full_sort_ms']:9.3f} ms  "
              f"top-K path {row['top_k_path_ms']:8.3f} ms  {row['speedup']:6.2f}x", file=sys.stderr)
    _emit(report, args.json_out)
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.attention import run_attention_bench

    _set_threads(args.threads)
    for name in ("batch", "context", "layers", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    dtypes = tuple(d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip())
    bad = [d for d in dtypes if d not in ("bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")]
    if not dtypes or bad:
        raise ValueError(f"--kv-cache-dtypes takes bfloat16, int8, fp8_e4m3, fp8_e5m2; got {args.kv_cache_dtypes!r}")
    report = run_attention_bench(args.batch, args.context, args.layers, args.placement, args.rounds, dtypes)
    print(f"{args.placement} blocks, {report['pool_mbytes']} MB pool: normal pages "
          f"{report['normal_pages']['us_per_layer']} us/layer, huge pages {report['huge_pages']['us_per_layer']} "
          f"us/layer, {report['huge_pages_speedup']}x", file=sys.stderr)
    for d in dtypes[1:]:
        print(f"{d} cache, huge pages: {report[d]['us_per_layer']} us/layer, "
              f"{report[d]['speedup_vs_' + dtypes[0]]}x {dtypes[0]}", file=sys.stderr)
    _emit(report, args.json_out)
    return 0


def cmd_kv_cache(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.kv_cache import run_kv_cache_bench

    threads = _set_threads(args.threads)
    dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in KV_CACHE_DTYPES]
    if len(dtypes) < 2 or bad:
        raise ValueError(f"--kv-cache-dtypes takes two or more of {', '.join(KV_CACHE_DTYPES)}; got {args.kv_cache_dtypes!r}")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    prompt_lens = [int(n) for n in args.prompt_lens.split(",") if n.strip()]
    if not batches or not prompt_lens or min(batches + prompt_lens) < 1 or args.rounds < 1 or args.parity_tokens < 1:
        raise ValueError("--batches, --prompt-lens, --rounds and --parity-tokens must be positive")
    kw = _llm_kwargs(args)
    kw.pop("kv_cache_dtype")
    kw.setdefault("max_num_seqs", max(batches))
    report = run_kv_cache_bench(kw, dtypes, batches, prompt_lens, args.rounds, args.parity_tokens)
    report["threads"] = threads
    for d, c in report["capacity"].items():
        print(f"{d:>9}: {c['kv_blocks']} blocks, {c['kv_bytes_per_token']} bytes/token", file=sys.stderr)
    for d, p in report["parity"].items():
        print(f"{d:>9}: {p['identical']}/{p['prompts']} prompts' greedy tokens identical, max |dlogprob| "
              f"{p['max_abs_logprob_diff']:.4f} over {p['compared_steps']} steps", file=sys.stderr)
    for row in report["decode_steps"]:
        print(json.dumps(row), file=sys.stderr)
    _emit(report, args.json_out)
    return 0


def cmd_startup(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench.startup import run_startup_bench

    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    _emit(run_startup_bench(serve_args, args.runs, args.discard_first, args.timeout), args.json_out)
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from tokenmill.engine.bench import peers

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in peers.ENGINES]
    if not engines or unknown:
        raise ValueError(f"--engines takes a comma list of {', '.join(peers.ENGINES)}; got {args.engines!r}")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError(f"--concurrency must list positive integers, got {args.concurrency!r}")
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if not workloads or any(w not in peers.WORKLOADS for w in workloads):
        raise ValueError(f"--workloads takes a comma list of {', '.join(peers.WORKLOADS)}; got {args.workloads!r}")
    clients = tuple(c.strip() for c in args.clients.split(",") if c.strip())
    if not clients or any(c not in peers.CLIENTS for c in clients):
        raise ValueError(f"--clients takes a comma list of {', '.join(peers.CLIENTS)}; got {args.clients!r}")
    out = Path(args.out)
    models = [_peer_model(m.strip(), "vllm" in engines) for m in args.models.split(",") if m.strip()]
    if not models:
        raise ValueError(f"--models takes a comma list of bundled, dense-bf16 or paths; got {args.models!r}")
    rows, weights = peers.run_peers(engines, concurrencies, args.num_prompts, out, models, port=args.port,
                                    workloads=workloads, clients=clients)  # fmt: skip
    table = peers.ratio_table(rows)
    machine = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    text = peers.markdown(table) + "\n" + peers.weights_markdown(weights)
    (out / "peers.md").write_text(text)
    peers.plot(table, str(out / "peers.png"), f"{', '.join(m.name for m in models)}; {machine}")
    print(text)
    _emit({"table": table}, str(out / "peers.json"))
    return 0


def _peer_model(spec: str, vllm: bool) -> Any:
    """bench peers' --models entry as a PeerModel: what tokenmill, vLLM and llama.cpp each serve. A path
    is named by its file or folder name in the tables (the full path is in the servers' logs)."""
    from tokenmill.engine.bench.peers import PeerModel

    if spec == "dense-bf16":
        from tokenmill.engine.bench.dense_model import ensure_dense_model

        folder = str(ensure_dense_model())
        return PeerModel(spec, folder, folder, None)
    if spec == "bundled":
        from tokenmill.engine.model.bundled import bundled_gguf_path

        path = bundled_gguf_path()
    else:
        path = Path(spec).resolve()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"--models {spec}: a folder needs a config.json (a Hugging Face model folder)")
            return PeerModel(path.name, str(path), str(path), None)
        if not path.is_file() or path.suffix != ".gguf":
            raise ValueError(f"--models {spec}: not bundled, dense-bf16, a .gguf file or a model folder")
    hf_dir = _model_dir(str(path))  # config and tokenizer (vLLM's client reads the tokenizer)
    if vllm:  # vLLM serves a Hugging Face folder: the GGUF's weights dequantized (fp32)
        from tokenmill.engine.model.gguf_cache import dequantized_copy_cached

        hf_dir = str(dequantized_copy_cached(path))
    return PeerModel(spec if spec == "bundled" else path.name, hf_dir, str(path), str(path))


COMMANDS = {"throughput": cmd_throughput, "serve": cmd_serve, "compare": cmd_compare, "roofline": cmd_roofline,
            "structured": cmd_structured, "output-path": cmd_output_path, "lora": cmd_lora,
            "peers": cmd_peers, "sampler": cmd_sampler, "startup": cmd_startup, "attention": cmd_attention,
            "kv-cache": cmd_kv_cache}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:
        print(f"tokenmill bench {args.command}: {e}", file=sys.stderr)
        return 2
