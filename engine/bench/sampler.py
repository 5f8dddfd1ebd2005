"""`tokenmill bench sampler`: CPU time per step of the sampler, the top-K path against the full sort.

Both runs use the same Sampler class on the same logits in one process: `max_candidates=0` turns the
top-K path off, so every random row takes the full sort over the vocabulary (what every row did before
the top-K path existed). Logits are random normal rows times --scale (3 by default: at temperature 0.2
a handful of tokens hold 90% of the mass, as with the bundled model; a small scale makes flat rows that
fall back to the full sort). Timed with process CPU time, interleaved rounds, best round kept.
"""

import time
from typing import Any

import torch
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.worker.sampler import Sampler

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "t0.2_top_p0.9": SamplingParams(temperature=0.2, top_p=0.9),
    "t1.0_top_k50_top_p0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
}


def _step_seconds(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], steps: int) -> float:
    sampler(logits.clone(), reqs)  # warm
    start = time.process_time()
    for _ in range(steps):
        sampler(logits.clone(), reqs)  # the engine hands the sampler a fresh logits tensor each step
    return (time.process_time() - start) / steps


def run_sampler_bench(batches: list[int], vocab: int, scale: float, steps: int, rounds: int) -> dict[str, Any]:
    device = torch.device("cpu")
    fast, full = Sampler(vocab, device), Sampler(vocab, device, max_candidates=0)
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        logits = torch.randn(batch, vocab, generator=g) * scale
        for name, params in CASES.items():
            reqs = [Request("b", i, [0], 1, params, arrival_time=0.0) for i in range(batch)]
            best = {"full_sort": float("inf"), "top_k_path": float("inf")}
            for _ in range(rounds):
                best["full_sort"] = min(best["full_sort"], _step_seconds(full, logits, reqs, steps))
                best["top_k_path"] = min(best["top_k_path"], _step_seconds(fast, logits, reqs, steps))
            rows.append({
                "batch": batch, "case": name,
                "full_sort_ms": round(best["full_sort"] * 1e3, 3),
                "top_k_path_ms": round(best["top_k_path"] * 1e3, 3),
                "speedup": round(best["full_sort"] / best["top_k_path"], 2),
            })  # fmt: skip
    return {"vocab": vocab, "scale": scale, "steps": steps, "rounds": rounds,
            "threads": torch.get_num_threads(), "rows": rows}  # fmt: skip
