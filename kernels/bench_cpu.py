"""CPU micro-benchmark: is the torch reference attention a bottleneck of a CPU decode step?

    python -m tokenmill.kernels.bench_cpu [--threads 1] [--dtype bf16|fp32|both] [--quick]

Shapes are the bundled SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, hidden 576,
intermediate 1536), block size 16, shuffled block tables. For each batch it prints, per layer:
- paged: tokenmill.kernels.paged_attention_decode(impl="torch"), validation included;
- dense: torch SDPA over K/V already contiguous per sequence ([seqs, kv_heads, max_len, head_dim],
  padding masked), i.e. an unpaged cache such as transformers' DynamicCache;
- loop: the obvious paged version, one sequence at a time (gather, matmul, softmax, matmul);
- cpp: the C++ CPU kernel (impl="cpu", the engine's CPU path), and the GB/s of K/V it read;
- linear: the layer's projections and MLP for the same batch (x @ W for q/k/v, o, gate/up, down),
  to show what share of the layer the attention is.
Then the same for prefill steps. Timings are the minimum over repeats; ratios compare like with like
in this process. Nothing is asserted.
"""

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tokenmill.kernels import paged_attention_decode, paged_attention_prefill

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 9, 3, 64, 576, 1536, 16
SCALE = HEAD_DIM**-0.5


def _ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _paged(seq_lens: list[int], dtype: torch.dtype, gen: torch.Generator):
    need = [math.ceil(n / BLOCK) for n in seq_lens]
    num_blocks = sum(need) + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    return k_cache, v_cache, table


def _dense(k_cache, table, seq_lens):
    """Each sequence's K (or V) copied out to contiguous [seqs, kv_heads, max_len, head_dim]."""
    max_len = max(seq_lens)
    out = torch.zeros(len(seq_lens), KV_HEADS, max_len, HEAD_DIM, dtype=k_cache.dtype)
    for i, n in enumerate(seq_lens):
        rows = k_cache[table[i, : math.ceil(n / BLOCK)].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
        out[i, :, :n] = rows.transpose(0, 1)
    return out


def _loop_decode(q, k_cache, v_cache, table, seq_lens):
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for i, n in enumerate(seq_lens):
        ids = table[i, : math.ceil(n / BLOCK)].long()
        k = k_cache[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float()
        v = v_cache[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float()
        qi = q[i].float().view(KV_HEADS, group, HEAD_DIM)
        s = torch.einsum("kgd,lkd->kgl", qi, k) * SCALE
        out[i] = torch.einsum("kgl,lkd->kgd", s.softmax(-1), v).reshape(HEADS, HEAD_DIM).to(q.dtype)
    return out


def _linear_fn(num_tokens: int, dtype: torch.dtype, gen: torch.Generator) -> Callable[[], object]:
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    w_qkv = torch.randn(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    w_o = torch.randn(HIDDEN, HIDDEN, generator=gen).to(dtype)
    w_gate_up = torch.randn(HIDDEN, 2 * INTER, generator=gen).to(dtype)
    w_down = torch.randn(INTER, HIDDEN, generator=gen).to(dtype)

    def run():
        x @ w_qkv
        x @ w_o
        h = x @ w_gate_up
        return h[:, :INTER] @ w_down

    return run


def bench_decode(
    batch: int, seq_lens: list[int], dtype: torch.dtype, repeats: int, gen: torch.Generator
) -> None:
    k_cache, v_cache, table = _paged(seq_lens, dtype, gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k_dense, v_dense = _dense(k_cache, table, seq_lens), _dense(v_cache, table, seq_lens)
    mask = (torch.arange(max(seq_lens))[None, :] < lens[:, None])[:, None, None, :]
    paged = _ms(
        lambda: paged_attention_decode(q, k_cache, v_cache, table, lens, SCALE, impl="torch"), repeats
    )
    dense = _ms(
        lambda: F.scaled_dot_product_attention(
            q[:, :, None], k_dense, v_dense, attn_mask=mask, scale=SCALE, enable_gqa=True
        ),
        repeats,
    )
    loop = _ms(lambda: _loop_decode(q, k_cache, v_cache, table, seq_lens), max(1, repeats // 2))
    cpp = _ms(lambda: paged_attention_decode(q, k_cache, v_cache, table, lens, SCALE, impl="cpu"), repeats)
    linear = _ms(_linear_fn(batch, dtype, gen), repeats)
    ctx = f"{min(seq_lens)}-{max(seq_lens)}" if min(seq_lens) != max(seq_lens) else str(seq_lens[0])
    print(
        f"decode  {str(dtype)[6:]:8} seqs={batch:3d} ctx={ctx:>9}: paged {paged:7.2f} ms | dense {dense:7.2f} ms "
        f"(paged/dense {paged / dense:4.2f}) | loop {loop:7.2f} ms (loop/paged {loop / paged:5.1f}) | "
        f"cpp {cpp:7.2f} ms (paged/cpp {paged / cpp:5.1f}, {_kv_gb(seq_lens, dtype) / cpp * 1e3:4.1f} GB/s) | "
        f"linear {linear:6.2f} ms -> attention share of layer {paged / (paged + linear):4.0%}"
    )


def _kv_gb(seq_lens: list[int], dtype: torch.dtype) -> float:
    """GB of K and V one layer reads for these contexts."""
    return sum(seq_lens) * 2 * KV_HEADS * HEAD_DIM * torch.tensor([], dtype=dtype).element_size() / 1e9


def bench_prefill(
    name: str, seq_lens: list[int], query_lens: list[int], dtype: torch.dtype, repeats: int, gen
) -> None:
    k_cache, v_cache, table = _paged(seq_lens, dtype, gen)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k_dense, v_dense = _dense(k_cache, table, seq_lens), _dense(v_cache, table, seq_lens)
    starts = qsl.tolist()

    def dense():  # one SDPA per sequence over its contiguous K/V, bottom-right causal mask
        for i, (n, L) in enumerate(zip(query_lens, seq_lens, strict=True)):
            qi = q[starts[i] : starts[i] + n].transpose(0, 1)[None]
            m = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
            F.scaled_dot_product_attention(
                qi,
                k_dense[i : i + 1, :, :L],
                v_dense[i : i + 1, :, :L],
                attn_mask=m,
                scale=SCALE,
                enable_gqa=True,
            )

    paged = _ms(
        lambda: paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, SCALE, impl="torch"), repeats
    )
    dense_ms = _ms(dense, repeats)
    cpp = _ms(lambda: paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, SCALE, impl="cpu"), repeats)
    linear = _ms(_linear_fn(sum(query_lens), dtype, gen), repeats)
    print(
        f"prefill {str(dtype)[6:]:8} {name:34}: paged {paged:7.2f} ms | dense {dense_ms:7.2f} ms "
        f"(paged/dense {paged / dense_ms:4.2f}) | cpp {cpp:7.2f} ms (paged/cpp {paged / cpp:5.1f}) | "
        f"linear {linear:6.2f} ms -> attention share of layer {paged / (paged + linear):4.0%}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU timing of the torch reference paged attention")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); times are per layer, min of repeats"
    )
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}[
        args.dtype
    ]
    repeats = 2 if args.quick else 5
    gen = torch.Generator().manual_seed(0)
    ragged = torch.randint(1, 2049, (256,), generator=gen).tolist()
    decode_cases = [(1, [512]), (32, [1024] * 32), (256, [512] * 256), (256, ragged)]
    if not args.quick:
        decode_cases += [(256, [2048] * 256), (8, [8192] * 8)]
    mixed_lens = [*torch.randint(600, 1500, (255,), generator=gen).tolist(), 1024]
    prefill_cases = [
        ("1 prompt x 2048 fresh", [2048], [2048]),
        ("16 prompts x 128 fresh", [128] * 16, [128] * 16),
        ("64 decodes + 64 x 24-token prompts", [300] * 64 + [24] * 64, [1] * 64 + [24] * 64),
        ("255 decodes + 512-token chunk at 512", mixed_lens, [1] * 255 + [512]),
    ]
    for dtype in dtypes:
        for batch, lens in decode_cases:
            bench_decode(batch, lens, dtype, repeats, gen)
        for name, seq_lens, query_lens in prefill_cases:
            bench_prefill(name, seq_lens, query_lens, dtype, repeats, gen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
