"""`tokenmill bench throughput`: offline, through the same engine the server runs.

Also the step counts the seeds compared, computed from the workload alone: one request at a time
(sum of output lengths), static batches of max_num_seqs in arrival order that each run to their
longest member (sum of per-batch maxima), and ideal continuous batching (each slot takes the next
waiting request the step after its last one finished; every request spends exactly max_tokens steps).
"""

import heapq
import time
from typing import Any

from tokenmill.engine.bench.datasets import BenchRequest


def sequential_steps(out_lens: list[int]) -> int:
    return sum(out_lens)


def static_batching_steps(out_lens: list[int], batch_size: int) -> int:
    return sum(max(out_lens[i : i + batch_size]) for i in range(0, len(out_lens), batch_size))


def ideal_continuous_steps(out_lens: list[int], slots: int) -> int:
    finish = [0] * min(slots, len(out_lens))
    for n in out_lens:
        heapq.heappush(finish, heapq.heappop(finish) + n)
    return max(finish, default=0)


def workload_step_counts(out_lens: list[int], max_num_seqs: int) -> dict[str, int]:
    return {
        "sequential": sequential_steps(out_lens),
        "static_batching": static_batching_steps(out_lens, max_num_seqs),
        "ideal_continuous_batching": ideal_continuous_steps(out_lens, max_num_seqs),
    }


def sampling_params_for(requests: list[BenchRequest]) -> list[Any]:
    from tokenmill.engine import SamplingParams

    return [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0) for r in requests]


def warm_up(llm: Any) -> None:
    """One short request so one-time costs (first allocations, lazy init) stay out of the timed run."""
    from tokenmill.engine import SamplingParams

    llm.generate(None, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                 prompt_token_ids=[[1, 2, 3, 4]], use_tqdm=False)
    llm.reset_stats()


def run_engine(llm: Any, requests: list[BenchRequest], use_tqdm: bool = True
               ) -> tuple[float, list[Any], list[float]]:
    """Submit every request at once and step the engine to the end, as LLM.generate does, also noting
    when each request finished (for completion-time percentiles).

    Returns (wall seconds, outputs in request order, seconds from submission to each one's finish).
    Checks that each output has exactly the tokens asked for.
    """
    from tqdm import tqdm

    engine = llm.engine
    params = sampling_params_for(requests)
    order: dict[str, int] = {}
    outs: list[Any] = [None] * len(requests)
    done: list[float] = [0.0] * len(requests)
    t0 = time.perf_counter()
    try:
        for i, (r, p) in enumerate(zip(requests, params, strict=True)):
            order[engine.add_request(None, list(r.prompt_token_ids), p)] = i
        with tqdm(total=len(requests), desc="requests", unit="req", disable=not use_tqdm, mininterval=1.0) as bar:
            while engine.has_unfinished_requests():
                finished = engine.step(emit_unfinished=False)
                now = time.perf_counter() - t0
                for out in finished:
                    i = order[out.request_id]
                    outs[i], done[i] = out, now
                    bar.update(1)
    except BaseException:
        for rid in order:  # leave no request holding KV blocks behind
            engine.abort_request(rid)
        raise
    seconds = time.perf_counter() - t0
    for i, (r, o) in enumerate(zip(requests, outs, strict=True)):
        got = len(o.outputs[0].token_ids) if o is not None else 0
        if got != r.max_tokens:
            raise RuntimeError(f"request {i}: asked for exactly {r.max_tokens} tokens (ignore_eos), got {got}")
    return seconds, outs, done


def throughput_report(
    requests: list[BenchRequest], seconds: float, stats: dict[str, Any], dtype: str, max_num_seqs: int
) -> dict[str, Any]:
    generated = sum(r.max_tokens for r in requests)
    steps = int(stats.get("num_steps", 0))
    return {
        "requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "num_steps": steps,
        "mean_tokens_per_step": generated / steps if steps else 0.0,
        "slot_occupancy": float(stats.get("mean_running_seqs", 0.0)) / max_num_seqs,
        "kv_utilization": float(stats.get("mean_kv_utilization", 0.0)),
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "num_preemptions": int(stats.get("num_preemptions", 0)),
        "prefix_cache_hit_tokens": int(stats.get("prefix_cache_hit_tokens", 0)),
        "kv_blocks_total": int(stats.get("kv_blocks_total", 0)),
        "workload_step_counts": workload_step_counts([r.max_tokens for r in requests], max_num_seqs),
    }


def run_static_on_engine(
    llm: Any, requests: list[BenchRequest], batch_size: int, use_tqdm: bool = True
) -> dict[str, Any]:
    """Static batching semantics on our own engine: batches of `batch_size` in arrival order, each run
    to completion (every member to the batch's longest output) before the next is admitted. Only the
    tokens each request asked for count as useful."""
    llm.reset_stats()
    t0 = time.perf_counter()
    steps = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        longest = max(r.max_tokens for r in batch)
        padded = [BenchRequest(max_tokens=longest, prompt_token_ids=r.prompt_token_ids) for r in batch]
        run_engine(llm, padded, use_tqdm=False)
        steps = int(llm.stats()["num_steps"])
        if use_tqdm:
            print(f"  static batch {i // batch_size + 1}/{-(-len(requests) // batch_size)}: "
                  f"{len(batch)} requests to {longest} tokens, {steps} steps so far", flush=True)
    seconds = time.perf_counter() - t0
    useful = sum(r.max_tokens for r in requests)
    return {
        "seconds": seconds,
        "num_steps": steps,
        "generated_tokens": useful,
        "tokens_per_s": useful / seconds,
        "batch_size": batch_size,
    }
