"""The tensor-parallel part of `python -m tokenmill.kernels.gpu_check` (run by it as `python -m
tokenmill.engine.bench.gpu_check_tp`, since it drives the engine): needs 2 or more CUDA GPUs.

1. NCCL all-reduce bus bandwidth between 2 GPUs (bf16, 256 MiB, as nccl-tests reports it), and the
   time of a decode-sized all-reduce (one token's hidden state, batch 1 and 64) eager and replayed from
   a CUDA graph (what TP decode steps do since graphs are captured per rank).
2. TP=2 greedy parity: a tiny random qwen2 model (4 heads, 2 KV heads; the bundled model's 9 heads do
   not split over 2 ranks) in fp32 on 2 GPUs, eager and with CUDA graphs, gives the tokens it gives
   on one GPU eager.
Fewer than 2 GPUs: prints why and skips (counts as passed). Never yet run on GPUs: no multi-GPU
machine has been lent to this project. `--cpu-smoke` runs the parity check's code on CPU (gloo,
eager only) so that it is known to run.
"""

import datetime
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ALLREDUCE_BYTES = 256 << 20
ALLREDUCE_ITERS = 20
DECODE_HIDDEN = 4096  # a 8B-class model's hidden size: the row-parallel all-reduce of one decode step
DECODE_BATCHES = (1, 64)
GRAPH_ITERS = 200
# Token ids below the tiny model's vocabulary of 1000.
PROMPTS = [[1, 504, 458, 314], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 906, 11, 856, 836, 374]]
MAX_TOKENS = 32


def _allreduce_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2)
    x = torch.ones(ALLREDUCE_BYTES // 2, dtype=torch.bfloat16, device=f"cuda:{rank}")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ALLREDUCE_ITERS):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / ALLREDUCE_ITERS
    if rank == 0:
        # bus bandwidth of a ring all-reduce over n ranks: 2 (n - 1) / n x bytes / time
        print(f"  nccl all-reduce 2 GPUs, {ALLREDUCE_BYTES >> 20} MiB bf16: {dt * 1e3:.2f} ms, "
              f"bus bandwidth {ALLREDUCE_BYTES / dt / 1e9:.0f} GB/s")  # fmt: skip
    for batch in DECODE_BATCHES:
        small = torch.zeros(batch, DECODE_HIDDEN, dtype=torch.bfloat16, device=f"cuda:{rank}")
        dist.all_reduce(small)  # warm-up outside the capture
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(GRAPH_ITERS):
            dist.all_reduce(small)
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / GRAPH_ITERS
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the same all-reduce, captured (torch.distributed over NCCL)
            for _ in range(10):
                dist.all_reduce(small)
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(GRAPH_ITERS // 10):
            graph.replay()
        torch.cuda.synchronize()
        replayed = (time.perf_counter() - t0) / GRAPH_ITERS
        if rank == 0:
            print(f"  nccl all-reduce [{batch}, {DECODE_HIDDEN}] bf16: eager {eager * 1e6:.1f} us, "
                  f"in a CUDA graph {replayed * 1e6:.1f} us")  # fmt: skip
    dist.destroy_process_group()


def allreduce_bandwidth() -> bool:
    from tokenmill.engine.executor.multiproc import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.engine.bench.gpu_check_tp", "--allreduce-rank"]
    # cwd "/": the repository root's operator/ package would shadow the standard library's operator.
    procs = [subprocess.Popen([*cmd, str(r), str(port)], cwd="/") for r in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        print(f"  FAIL nccl all-reduce: rank exit codes {codes}")
    return not any(codes)


def greedy_tokens(
    model: pathlib.Path, tp: int, enforce_eager: bool, device: str = "cuda"
) -> tuple[list[list[int]], list[int]]:
    """(tokens per prompt, the batch sizes rank 0 captured CUDA graphs for: [] when eager)."""
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.core import EngineCoreRequest
    from tokenmill.engine.core.engine_core import EngineCore
    from tokenmill.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(model), dtype="float32", device=device, tensor_parallel_size=tp, num_kv_blocks=256,
        max_model_len=256, enforce_eager=enforce_eager,
    )  # fmt: skip
    core = EngineCore(config)
    graphs = core.executor.worker.runner.graphs
    captured = sorted(graphs.graphs) if graphs is not None else []
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for i, ids in enumerate(PROMPTS):
            core.add_request(EngineCoreRequest(str(i), ids, params, 0.0, 0))
        out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while core.has_unfinished_requests():
            for o in core.step()[0]:
                out[o.request_id] += o.new_token_ids
        return [out[str(i)] for i in range(len(PROMPTS))], captured
    finally:
        core.shutdown()


def parity(device: str, modes: tuple[bool, ...]) -> bool:
    """TP=2 greedy tokens equal TP=1 eager, for each enforce_eager in modes."""
    from tokenmill.engine.bench.parallel import tiny_model

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(pathlib.Path(tmp))
        one, _ = greedy_tokens(model, 1, enforce_eager=True, device=device)
        for eager in modes:
            two, captured = greedy_tokens(model, 2, enforce_eager=eager, device=device)
            mode = "eager" if eager else f"CUDA graphs captured for {captured}"
            same = one == two and (eager or bool(captured))
            print(f"  {'ok  ' if same else 'FAIL'} TP=2 greedy tokens ({mode}; fp32, {device}, tiny qwen2, "
                  f"{len(PROMPTS)} prompts x {MAX_TOKENS}) equal TP=1 eager")  # fmt: skip
            if not same:
                print(f"    TP=1 {one}\n    TP=2 {two}")
            ok = ok and same
    return ok


def check_tensor_parallel() -> bool:
    """True when every TP check passed or there are fewer than 2 GPUs (skipped)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"tensor parallel: skipped, {n} CUDA GPU(s) visible (needs 2)")
        return True
    print("tensor parallel")
    ok = allreduce_bandwidth()
    return parity("cuda", (True, False)) and ok


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--allreduce-rank":
        _allreduce_rank(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:] == ["--cpu-smoke"]:
        print("tensor parallel, CPU smoke run (gloo, eager)")
        sys.exit(0 if parity("cpu", (True,)) else 1)
    else:
        sys.exit(0 if check_tensor_parallel() else 1)
