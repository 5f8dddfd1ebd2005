"""`tokenmill bench attention`: the CPU decode attention kernel over a KV pool as big as a model's, on
normal pages and on transparent huge pages (engine/worker/huge_pages.py), in one process.

Each "layer" has its own blocks, so a step's reads do not stay in cache (the bundled model has 30 layers:
64 sequences of 176 tokens are 250 MB of bf16 K/V). Blocks are placed in random order across the pool,
as a long-running server's free list leaves them, or in order (--placement contiguous), as a fresh pool
hands them out. Timed with wall time, interleaved rounds, best round kept.
"""

import time
from typing import Any

import torch
from tokenmill.engine.worker.huge_pages import zeros_huge_pages
from tokenmill.kernels import cpu as cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the bundled model's attention


def _pool(num_blocks: int, huge: bool) -> torch.Tensor:
    shape = (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pool = zeros_huge_pages(shape, torch.bfloat16) if huge else torch.zeros(shape, dtype=torch.bfloat16)
    return pool.normal_()


def run_attention_bench(batch: int, context: int, layers: int, placement: str, rounds: int) -> dict[str, Any]:
    ops = cpu_kernels.load()
    if ops is None:
        raise RuntimeError("the C++ CPU kernels are not available on this machine")
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq * layers
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(num_blocks, generator=g) if placement == "scattered" else torch.arange(num_blocks)
    tables = [order[i * batch * per_seq : (i + 1) * batch * per_seq].view(batch, per_seq).int().contiguous()
              for i in range(layers)]  # fmt: skip
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16()
    out = torch.empty_like(q)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    pools = {"normal_pages": _pool(num_blocks, False), "huge_pages": _pool(num_blocks, True)}

    def step(pool: torch.Tensor) -> float:
        t = time.perf_counter()
        for table in tables:
            ops.paged_attention_varlen(out, q, pool[0], pool[1], table, starts, lens, HEAD_DIM**-0.5, 1 << 30, 1 << 40)
        return (time.perf_counter() - t) / layers

    best = {name: float("inf") for name in pools}
    for pool in pools.values():
        step(pool)  # warm: the kernels' first call, the pages' first touch by this loop
    for _ in range(rounds):
        for name, pool in pools.items():
            best[name] = min(best[name], step(pool))
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16, per layer
    rows = {name: {"us_per_layer": round(s * 1e6, 1), "kv_gbytes_per_s": round(kv_bytes / s / 1e9, 2)}
            for name, s in best.items()}  # fmt: skip
    return {
        "batch": batch, "context": context, "layers": layers, "placement": placement, "rounds": rounds,
        "pool_mbytes": round(num_blocks * BLOCK * KV_HEADS * HEAD_DIM * 2 * 2 / 2**20, 1),
        "threads": torch.get_num_threads(), **rows,
        "huge_pages_speedup": round(best["normal_pages"] / best["huge_pages"], 2),
    }  # fmt: skip
