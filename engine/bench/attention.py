"""`tokenmill bench attention`: the CPU decode attention kernel over a KV pool as big as a model's, on
normal pages and on transparent huge pages (engine/worker/huge_pages.py), and for each KV cache dtype
asked for (bf16, and the 8-bit int8 / fp8_e4m3 / fp8_e5m2 caches of kernels/kv_quant.py), in one process.

Each "layer" has its own blocks, so a step's reads do not stay in cache (the bundled model has 30 layers:
64 sequences of 176 tokens are 250 MB of bf16 K/V). Blocks are placed in random order across the pool,
as a long-running server's free list leaves them, or in order (--placement contiguous), as a fresh pool
hands them out. Timed with wall time, interleaved rounds, best round kept.
"""

import time
from typing import Any

import torch
from tokenmill.engine import kv_memory
from tokenmill.engine.worker.device import KV_CACHE_TORCH_DTYPES
from tokenmill.engine.worker.huge_pages import zeros_huge_pages
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels import kv_quant

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the bundled model's attention


def _pool(num_blocks: int, huge: bool, kv_cache_dtype: str) -> torch.Tensor:
    """[K/V, blocks, BLOCK, KV_HEADS, row] of random K/V (8-bit: quantized rows with their scales)."""
    shape = (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    values = torch.randn(shape).bfloat16()
    dtype = KV_CACHE_TORCH_DTYPES[kv_cache_dtype]
    width = kv_memory.kv_row_bytes(HEAD_DIM, kv_cache_dtype) // dtype.itemsize
    pool = zeros_huge_pages((*shape[:-1], width), dtype) if huge else torch.zeros((*shape[:-1], width), dtype=dtype)
    pool.copy_(kv_quant.quantize_rows(values, dtype) if kv_cache_dtype in kv_memory.KV_QUANT_DTYPES else values)
    return pool


def run_attention_bench(
    batch: int, context: int, layers: int, placement: str, rounds: int, kv_cache_dtypes: tuple[str, ...] = ("bfloat16",)
) -> dict[str, Any]:
    """Normal against huge pages for the first cache dtype; every other dtype on huge pages, with its speed
    relative to the first's."""
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
    first = kv_cache_dtypes[0]
    pools = {"normal_pages": _pool(num_blocks, False, first), "huge_pages": _pool(num_blocks, True, first)}
    for dtype in kv_cache_dtypes[1:]:
        pools[dtype] = _pool(num_blocks, True, dtype)

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
    rows = {}
    for name, s in best.items():
        dtype = first if name in ("normal_pages", "huge_pages") else name
        kv_bytes = batch * context * KV_HEADS * kv_memory.kv_row_bytes(HEAD_DIM, dtype) * 2  # K and V, per layer
        rows[name] = {"us_per_layer": round(s * 1e6, 1), "kv_gbytes_per_s": round(kv_bytes / s / 1e9, 2)}
        if name not in ("normal_pages", "huge_pages"):
            rows[name]["speedup_vs_" + first] = round(best["huge_pages"] / s, 2)
    return {
        "batch": batch, "context": context, "layers": layers, "placement": placement, "rounds": rounds,
        "kv_cache_dtype": first,
        "pool_mbytes": round(num_blocks * BLOCK * KV_HEADS * kv_memory.kv_row_bytes(HEAD_DIM, first) * 2 / 2**20, 1),
        "threads": torch.get_num_threads(), **rows,
        "huge_pages_speedup": round(best["normal_pages"] / best["huge_pages"], 2),
    }  # fmt: skip
