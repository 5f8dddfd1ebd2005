"""`tokenmill bench compare`: our engine against the Hugging Face baselines in one process.

Same weights (the engine's resolved model folder), dtype and workload for every system. tokenmill runs
the whole workload; each baseline runs an evenly spaced subset when the whole would take too long
(sizes are options), and the table says which rows are subsets.
"""

import os
import time
from typing import Any

import torch
from tokenmill.engine.bench import baselines
from tokenmill.engine.bench.baselines import SystemResult
from tokenmill.engine.bench.datasets import BenchRequest, subsample
from tokenmill.engine.bench.report import format_table, plot, result_row
from tokenmill.engine.bench.roofline import DTYPES
from tokenmill.engine.bench.throughput import run_engine, warm_up


def run_tokenmill(llm: Any, requests: list[BenchRequest], max_num_seqs: int) -> tuple[SystemResult, dict]:
    warm_up(llm)
    cpu0 = time.process_time()
    seconds, _, times = run_engine(llm, requests, use_tqdm=True)
    result = SystemResult(f"tokenmill ({max_num_seqs} seqs)", len(requests),
                          sum(r.max_tokens for r in requests), seconds, times,
                          cpu_seconds=time.process_time() - cpu0)
    return result, llm.stats()


def run_compare(
    llm: Any,
    model_dir: str,
    dtype: str,
    requests: list[BenchRequest],
    max_num_seqs: int,
    block_size: int,
    max_num_batched_tokens: int,
    static_batch: int,
    subset_sizes: dict[str, int],
    pad_token_id: int,
    plot_path: str | None,
    skip: set[str],
) -> dict[str, Any]:
    results: list[SystemResult] = []
    t_start = time.perf_counter()
    print(f"tokenmill on all {len(requests)} requests", flush=True)
    load = os.getloadavg()[0]
    tm, stats = run_tokenmill(llm, requests, max_num_seqs)
    tm.note = _load_note(load)

    model = baselines.load_hf_model(model_dir, DTYPES[dtype])
    runs = {
        "naive": ("hf naive", lambda sub: baselines.run_naive(model, sub, pad_token_id)),
        "static": (f"hf static batches of {static_batch}",
                   lambda sub: baselines.run_static(model, sub, static_batch, pad_token_id)),
        "hf-cb": ("hf continuous batching", lambda sub: baselines.run_hf_continuous(
            model, sub, max_num_seqs, block_size, max_num_batched_tokens)),
    }
    for key, (label, run) in runs.items():
        if key in skip:
            continue
        subset = subsample(requests, subset_sizes[key])
        print(f"{label} on {len(subset)} of {len(requests)} requests", flush=True)
        load, cpu0 = os.getloadavg()[0], time.process_time()
        results.append(run(subset))
        results[-1].cpu_seconds = time.process_time() - cpu0
        results[-1].note = _load_note(load)
    results.append(tm)

    naive = next((r for r in results if r.name.startswith("hf naive")), None)
    naive_tps = naive.tokens_per_s if naive else None
    rows = [result_row(r, naive, len(requests)) for r in results]
    hf_cb = next((r for r in results if r.name.startswith("hf continuous")), None)
    subset_note = [f"{r['system']}: {r['requests']} of {len(requests)} requests (evenly spaced subset; "
                   "tokens/s is comparable, completion times grow with the number of requests)"
                   for r in rows if r["subset"]]
    report = {
        "requests": len(requests),
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "static_batch": static_batch,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "subsets": subset_note,
        "tokenmill_vs_naive": tm.tokens_per_s / naive_tps if naive_tps else None,
        "tokenmill_vs_hf_continuous": tm.tokens_per_s / hf_cb.tokens_per_s if hf_cb else None,
        "tokenmill_vs_naive_cpu": tm.tokens_per_cpu_s / naive.tokens_per_cpu_s if naive else None,
        "tokenmill_vs_hf_continuous_cpu": tm.tokens_per_cpu_s / hf_cb.tokens_per_cpu_s if hf_cb else None,
        "tokenmill_stats": stats,
        "total_seconds": time.perf_counter() - t_start,
    }
    print()
    print(format_table(rows))
    for line in subset_note:
        print(f"  subset: {line}")
    if plot_path:
        title = (f"{len(requests)} requests, dtype {dtype}, {torch.get_num_threads()} thread(s); "
                 "baselines on the subsets shown")
        plot(results, naive_tps, plot_path, title)
        print(f"plot written to {plot_path}")
    return report


def _load_note(load_before: float) -> str:
    # Other jobs share the machine: the 1-minute load average before and after each run says how much.
    return f"load avg {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
