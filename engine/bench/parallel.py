"""Per-step cost of tensor parallel on this machine: `python -m tokenmill.engine.bench.parallel`.

Builds a tiny random qwen2 model (transformers' config class, fp32, CPU), runs decode steps of an
EngineCore at TP=1 and TP=2 for each batch size, and prints the median step time, the TP=2 / TP=1
ratio, and rank 0's median time inside the per-step broadcast (step_input.broadcast_step: the write
into the shared-memory ring; TP=1 has none). Then a ping-pong between two processes over two rings
gives the one-way delivery latency of a step message (stamped by the writer, read by the reader's
clock, wake-up included) and half the round trip. Prints the load average first and last: a shared
machine inflates every figure.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

DECODE_STEPS = 50
PROMPT_LEN = 8


def tiny_model(folder: pathlib.Path) -> pathlib.Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"], bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def step_times(model: pathlib.Path, tp: int, batch: int, pp: int = 1) -> tuple[float, float]:
    """(median decode step seconds, median seconds rank 0 spends in broadcast_step)."""
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.core import EngineCoreRequest
    from tokenmill.engine.core.engine_core import EngineCore
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.engine.worker import model_runner

    inside: list[float] = []
    real = model_runner.broadcast_step

    def timed(step: object, par: object) -> None:
        t0 = time.perf_counter()
        real(step, par)
        inside.append(time.perf_counter() - t0)

    model_runner.broadcast_step = timed
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", tensor_parallel_size=tp, num_kv_blocks=256,
        pipeline_parallel_size=pp,
        max_model_len=128, max_num_seqs=max(batch, 1),
    )  # fmt: skip
    core = EngineCore(config)
    try:
        params = SamplingParams(max_tokens=DECODE_STEPS + 20, temperature=0, ignore_eos=True)
        for i in range(batch):
            ids = [(i * 7 + j) % 997 + 3 for j in range(PROMPT_LEN)]
            core.add_request(EngineCoreRequest(str(i), ids, params, 0.0, 0))
        for _ in range(5):  # prefill and warm-up
            core.step()
        inside.clear()
        times = []
        for _ in range(DECODE_STEPS):
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
    finally:
        core.shutdown()
        model_runner.broadcast_step = real
    return float(np.median(times)), float(np.median(inside)) if inside else 0.0


def pong(ping_path: str, pong_path: str, chunk: int, rounds: int) -> None:
    """The other process of the ping-pong: read each message from one ring, note how long after its
    write it arrived (word 0 is the writer's CLOCK_MONOTONIC in ns, the same clock in both processes),
    echo it on the other ring; finally send the median of those one-way delays."""
    from tokenmill.engine.distributed.shm_broadcast import ShmRing

    inbox = ShmRing.attach(ping_path, 1, chunk, 0)
    outbox = ShmRing.attach(pong_path, 1, chunk, None)
    delays = []
    for _ in range(rounds):
        msg = inbox.read()
        delays.append(time.perf_counter_ns() - int(msg.view(np.int64)[0]))
        outbox.write(msg, timeout_s=60)
    outbox.write(np.array([int(np.median(delays))], dtype=np.int64), timeout_s=60)


def ping_pong(words: int, rounds: int = 2000) -> tuple[float, float]:
    """(median one-way delivery seconds, stamped at the write and read at the reader; median round
    trip / 2) for a message of `words` int64 between two processes."""
    from tokenmill.engine.distributed.shm_broadcast import ShmRing

    chunk = 8 * words
    ping = ShmRing.create(1, chunk)
    back = ShmRing.create(1, chunk)
    reader = ShmRing.attach(back.path, 1, chunk, 0)
    cmd = [sys.executable, "-m", "tokenmill.engine.bench.parallel", "--pong", ping.path, back.path,
           str(chunk), str(rounds)]  # fmt: skip
    child = subprocess.Popen(cmd, cwd="/")  # not the repo root: its operator/ would shadow the stdlib's
    try:
        msg = np.arange(words, dtype=np.int64)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            msg[0] = time.perf_counter_ns()  # perf_counter is CLOCK_MONOTONIC: one clock for both processes
            ping.write(msg, timeout_s=60)
            reader.read()
            times.append((time.perf_counter() - t0) / 2)
        one_way = int(reader.read().view(np.int64)[0]) / 1e9
        child.wait(60)
    finally:
        ping.unlink()
        back.unlink()
        if child.poll() is None:
            child.kill()
    return one_way, float(np.median(times))


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenmill.engine.bench.parallel")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--pp", action="store_true", help="also PP=2 (one pipeline batch in flight)")
    ap.add_argument("--ring-only", action="store_true", help="only the ring's latency (a few seconds)")
    ap.add_argument("--pong", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ring_only:
        args.batch = []
    if args.pong:
        pong(args.pong[0], args.pong[1], int(args.pong[2]), int(args.pong[3]))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, {load()}; tiny qwen2, fp32, CPU", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(pathlib.Path(tmp)) if args.batch else None
        for batch in args.batch:
            one, _ = step_times(model, 1, batch)
            two, inside = step_times(model, 2, batch)
            print(
                f"batch {batch:3d}: step TP=1 {one * 1e3:7.2f} ms, TP=2 {two * 1e3:7.2f} ms "
                f"(x{two / one:.2f}, +{(two - one) * 1e3:.2f} ms); rank 0 in the broadcast {inside * 1e6:.1f} us",
                flush=True,
            )
            if args.pp:  # one batch in flight: each stage waits for the other, steps do not overlap
                pp2, _ = step_times(model, 1, batch, pp=2)
                print(f"batch {batch:3d}: step PP=2 {pp2 * 1e3:7.2f} ms (x{pp2 / one:.2f} of TP=1 x PP=1)",
                      flush=True)  # fmt: skip
    for words in (6 + 7 * 1 + 1, 6 + 7 * 64 + 64):  # a packed decode step of batch 1 / 64, 1 block each
        one_way, half_trip = ping_pong(words)
        print(f"ring, {8 * words} bytes: one-way delivery {one_way * 1e6:.1f} us (median, stamped at the "
              f"write), round trip / 2 {half_trip * 1e6:.1f} us", flush=True)  # fmt: skip
    print(f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, {load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
