"""Check every Triton kernel against the torch reference on a CUDA device and time paged decode.

    python -m tokenmill.kernels.gpu_check            # on a CUDA machine, finishes in a few minutes
    python -m tokenmill.kernels.gpu_check --cpu-smoke  # tiny shapes through the Triton interpreter

What it does (figures go to docs/kernels.md):
1. Correctness: store_kv (exact) and decode/prefill (max abs error vs the reference, per-dtype
   tolerance) over fp32/fp16/bf16, head_dim 64/128, block size 16/32, GQA, ragged lengths, shuffled
   block tables, prefill chunks starting mid-block; then the issue's realistic shape (64 sequences x
   2048 tokens, 32 heads, 8 KV heads, head_dim 128, bf16). The 8-bit caches (fp8_e4m3 and int8 codes with a
   scale per token and head, kernels/kv_quant.py) the same way under bf16 queries: store_kv bytes exact.
2. Decode replayed as a CUDA graph equals eager decode.
3. Timing: decode kernel time, achieved GB/s of K/V read vs the device's copy bandwidth, and
   torch SDPA over the same K/V gathered into contiguous (unpaged) tensors; the 8-bit caches' decode time
   and GB/s at the realistic shape beside bf16's.
4. Tensor parallel (engine/bench/gpu_check_tp.py, in its own process): NCCL all-reduce bandwidth, a decode-sized all-reduce eager and
   in a CUDA graph, TP=2 greedy parity eager and with per-rank CUDA graphs; skipped with fewer than
   2 GPUs (never run yet: no multi-GPU machine has been lent).
Exit status: 0 all checks pass, 1 a check failed, 2 no CUDA device.
"""

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tokenmill.kernels import kv_quant, paged_attention_decode, paged_attention_prefill, store_kv

# Triton vs the torch reference passes when |out - ref| <= atol + rtol * |ref| everywhere. Both
# accumulate in fp32; half precisions differ by probability/output rounding (about 2 output ulps).
# The same figures as the CPU tests (tests/test_kernels_common.py).
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1.5e-3, 4e-3), torch.bfloat16: (1e-2, 1.6e-2)}

_failures: list[str] = []


def _report(name: str, out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float]) -> None:
    atol, rtol = tol
    diff = (out.float() - ref.float()).abs()
    ok = bool((diff <= atol + rtol * ref.float().abs()).all())
    err = diff.max().item() if diff.numel() else 0.0
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max abs err {err:.3g} (atol {atol:g} + rtol {rtol:g})")
    if not ok:
        _failures.append(name)


def _tables(seq_lens: list[int], block_size: int, device: torch.device, gen: torch.Generator):
    """Shuffled, non-contiguous block tables (-1 padded) and the number of blocks they use."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + 7
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    return table.to(device), num_blocks


def _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen, kv=None):
    """Random K/V caches of `dtype`, or with kv (an 8-bit dtype) those values quantized into kv's rows."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    if kv is not None:
        k, v = kv_quant.quantize_rows(k, kv), kv_quant.quantize_rows(v, kv)
    return k, v


def _kv_name(dtype, kv) -> str:
    return str(dtype) if kv is None else f"{dtype} q, {kv} cache"


def check_store_kv(device, dtype, num_tokens, num_kv_heads, head_dim, block_size, gen, kv=None) -> None:
    num_blocks = math.ceil(num_tokens / block_size) + 4
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen, kv)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    slots = slots.to(device)
    store_kv(key, value, k_cache, v_cache, slots, impl="triton")
    store_kv(key, value, k_ref, v_ref, slots, impl="torch")
    name = f"store_kv {_kv_name(dtype, kv)} tokens={num_tokens} kv_heads={num_kv_heads} d={head_dim} (exact)"
    if kv is not None:  # the bytes: codes and scales
        k_cache, v_cache, k_ref, v_ref = (t.view(torch.uint8) for t in (k_cache, v_cache, k_ref, v_ref))
    _report(name, torch.cat([k_cache, v_cache]), torch.cat([k_ref, v_ref]), (0.0, 0.0))


def check_decode(device, dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, gen, kv=None) -> None:
    table, num_blocks = _tables(seq_lens, block_size, device, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen, kv)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = paged_attention_decode(q, k_cache, v_cache, table, lens, scale, impl="triton")
    ref = paged_attention_decode(q, k_cache, v_cache, table, lens, scale, impl="torch")
    name = f"decode {_kv_name(dtype, kv)} seqs={len(seq_lens)} max_len={max(seq_lens)} H={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}"
    _report(name, out, ref, TOL[dtype])


def check_prefill(
    device, dtype, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, gen, kv=None
) -> None:
    table, num_blocks = _tables(seq_lens, block_size, device, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen, kv)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, scale, impl="triton")
    ref = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, scale, impl="torch")
    name = f"prefill {_kv_name(dtype, kv)} chunks={query_lens} of {seq_lens} H={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}"
    _report(name, out, ref, TOL[dtype])


def _time_cuda(fn: Callable[[], object], iters: int) -> float:
    """Mean milliseconds per call, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read + bytes written per second (GB = 1e9 bytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_cuda(lambda: dst.copy_(src), 20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_decode(
    device, dtype, num_seqs, seq_len, num_heads, num_kv_heads, head_dim, block_size, copy_gbs, gen, kv=None
):
    seq_lens = [seq_len] * num_seqs
    table, num_blocks = _tables(seq_lens, block_size, device, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen, kv)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    def decode():
        return paged_attention_decode(q, k_cache, v_cache, table, lens, scale, impl="triton")

    eager = decode()
    # CUDA graph: the engine captures decode steps; replay must equal eager.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = decode()
    graph.replay()
    torch.cuda.synchronize()
    _report(f"decode CUDA graph replay == eager ({num_seqs}x{seq_len})", graph_out, eager, (0.0, 0.0))

    nb = math.ceil(seq_len / block_size)
    if kv is not None:  # SDPA reads the dequantized values
        k_cache, v_cache = kv_quant.dequantize_rows(k_cache, dtype), kv_quant.dequantize_rows(v_cache, dtype)
    k_dense = k_cache[table[:, :nb].long()].reshape(num_seqs, nb * block_size, num_kv_heads, head_dim)[
        :, :seq_len
    ]
    v_dense = v_cache[table[:, :nb].long()].reshape(num_seqs, nb * block_size, num_kv_heads, head_dim)[
        :, :seq_len
    ]
    k_dense = k_dense.transpose(1, 2).contiguous()
    v_dense = v_dense.transpose(1, 2).contiguous()
    q4 = q[:, :, None, :]

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)

    _report(f"decode vs SDPA on gathered K/V ({num_seqs}x{seq_len})", eager, sdpa()[:, :, 0], TOL[dtype])

    iters = 50
    t_eager = _time_cuda(decode, iters)
    t_graph = _time_cuda(graph.replay, iters)
    t_sdpa = _time_cuda(sdpa, iters)
    row_bytes = head_dim * k_cache.element_size() + (kv_quant.KV_SCALE_BYTES if kv is not None else 0)
    kv_bytes = 2 * num_seqs * seq_len * num_kv_heads * row_bytes
    gbs = kv_bytes / (t_graph * 1e-3) / 1e9
    print(
        f"  decode {_kv_name(dtype, kv)} {num_seqs} seqs x {seq_len} tokens, H={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}: "
        f"eager {t_eager * 1e3:.1f} us, graph {t_graph * 1e3:.1f} us, KV read {kv_bytes / 1e6:.0f} MB -> {gbs:.0f} GB/s "
        f"= {gbs / copy_gbs:.2f} x copy bandwidth; SDPA on unpaged K/V {t_sdpa * 1e3:.1f} us "
        f"(paged/SDPA time ratio {t_graph / t_sdpa:.2f})"
    )


def correctness(device: torch.device, small: bool, gen: torch.Generator) -> None:
    print("correctness: Triton vs torch reference")
    long = 70 if small else 1500
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        check_store_kv(device, dtype, 50 if small else 4096, 8, 128, 16, gen)
        for head_dim in (64, 128):
            for block_size in (16, 32):
                bs = block_size
                ragged = [
                    1,
                    bs - 1,
                    bs,
                    bs + 1,
                    long,
                    *torch.randint(1, long, (3 if small else 40,), generator=gen).tolist(),
                ]
                check_decode(device, dtype, ragged, 8, 2, head_dim, block_size, gen)  # GQA 4
                seq_lens = [bs + 5, long, 2 * bs + 3, 1, bs]
                query_lens = [
                    bs + 5,
                    long - bs // 2 - 3,
                    7,
                    1,
                    bs,
                ]  # fresh, mid-block chunk, short chunk, decode row
                check_prefill(device, dtype, seq_lens, query_lens, 6, 2, head_dim, block_size, gen)  # GQA 3
    for kv in (torch.float8_e4m3fn, torch.int8):  # --kv-cache-dtype fp8 / int8 under a bf16 model
        check_store_kv(device, torch.bfloat16, 50 if small else 4096, 8, 128, 16, gen, kv)
        for head_dim in (64, 128):
            ragged = [1, 15, 16, 17, long, *torch.randint(1, long, (3 if small else 40,), generator=gen).tolist()]
            check_decode(device, torch.bfloat16, ragged, 8, 2, head_dim, 16, gen, kv)
            check_prefill(device, torch.bfloat16, [21, long, 35, 1, 16], [21, long - 11, 7, 1, 16], 6, 2, head_dim, 16,
                          gen, kv)  # fmt: skip
    if not small:
        print("correctness at the realistic shape (64 x 2048, 32 heads, 8 KV heads, d=128, bf16)")
        check_decode(device, torch.bfloat16, [2048] * 64, 32, 8, 128, 16, gen)
        check_decode(
            device, torch.bfloat16, torch.randint(1, 4096, (64,), generator=gen).tolist(), 32, 8, 128, 16, gen
        )
        check_prefill(
            device, torch.bfloat16, [2048, 3000, 1024, 2048], [2048, 1000, 1024, 1], 32, 8, 128, 16, gen
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny correctness pass through TRITON_INTERPRET=1, no timing"
    )
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernel modules are first imported
        torch.set_num_threads(1)
        correctness(torch.device("cpu"), small=True, gen=gen)
    else:
        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device visible (torch.cuda.is_available() is False). It checks and times the"
            )
            print(
                "Triton kernels and needs a CUDA GPU; on CPU run the tests, or --cpu-smoke for the interpreter."
            )
            return 2
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        print(
            f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}"
        )
        correctness(device, small=False, gen=gen)
        copy_gbs = copy_bandwidth_gbs(device)
        print(f"timing (device copy bandwidth, read+write: {copy_gbs:.0f} GB/s)")
        bench_decode(device, torch.bfloat16, 64, 2048, 32, 8, 128, 16, copy_gbs, gen)
        for kv in (torch.float8_e4m3fn, torch.int8):  # the 8-bit caches: half the bytes
            bench_decode(device, torch.bfloat16, 64, 2048, 32, 8, 128, 16, copy_gbs, gen, kv)
        bench_decode(device, torch.bfloat16, 64, 2048, 32, 8, 128, 32, copy_gbs, gen)
        bench_decode(device, torch.bfloat16, 256, 1024, 32, 8, 128, 16, copy_gbs, gen)
        bench_decode(device, torch.bfloat16, 4, 8192, 32, 8, 128, 16, copy_gbs, gen)
        bench_decode(
            device, torch.bfloat16, 256, 1024, 9, 3, 64, 16, copy_gbs, gen
        )  # the bundled SmolLM2 shape
        # NCCL all-reduce bandwidth and TP=2 parity run the engine, which kernels/ does not import: its
        # own process (it skips, passing, under 2 GPUs).
        tp = subprocess.run([sys.executable, "-m", "tokenmill.engine.bench.gpu_check_tp"], cwd="/")
        if tp.returncode != 0:
            _failures.append("tensor parallel")
    print(f"{len(_failures)} check(s) failed; took {time.perf_counter() - start:.0f} s")
    return 1 if _failures else 0


if __name__ == "__main__":
    sys.exit(main())
