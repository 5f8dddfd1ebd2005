"""Per-step cost of tensor parallel on this machine: `python -m tokenmill.engine.parallel_bench`.

Builds a tiny random qwen2 model (transformers' config class, fp32, CPU), runs decode steps of an
EngineCore at TP=1 and TP=2 for each batch size, and prints the median step time, the TP=2 / TP=1
ratio, and rank 0's median time inside the per-step broadcast (step_input.broadcast_step: the write
into the shared-memory ring). Then a ping-pong between two processes over two rings gives the
one-way latency of a step message including the reader's wake-up. Prints the load average first:
a shared machine inflates every figure.
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


def step_times(model: pathlib.Path, tp: int, batch: int) -> tuple[float, float]:
    """(median decode step seconds, median seconds rank 0 spends in broadcast_step)."""
    from tokenmill.engine import model_runner
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.engine.outputs import EngineCoreRequest
    from tokenmill.engine.sampling_params import SamplingParams

    inside: list[float] = []
    real = model_runner.broadcast_step

    def timed(step: object, par: object) -> None:
        t0 = time.perf_counter()
        real(step, par)
        inside.append(time.perf_counter() - t0)

    model_runner.broadcast_step = timed
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", tensor_parallel_size=tp, num_kv_blocks=256,
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
    """The other process of the ping-pong: read each message from one ring, echo it on the other."""
    from tokenmill.engine.shm_broadcast import ShmRing

    inbox = ShmRing.attach(ping_path, 1, chunk, 0)
    outbox = ShmRing.attach(pong_path, 1, chunk, None)
    for _ in range(rounds):
        outbox.write(inbox.read(), timeout_s=60)


def ping_pong(words: int, rounds: int = 2000) -> float:
    """Median one-way seconds for a message of `words` int64 between two processes."""
    from tokenmill.engine.shm_broadcast import ShmRing

    chunk = 8 * words
    ping = ShmRing.create(1, chunk)
    back = ShmRing.create(1, chunk)
    reader = ShmRing.attach(back.path, 1, chunk, 0)
    cmd = [sys.executable, "-m", "tokenmill.engine.parallel_bench", "--pong", ping.path, back.path,
           str(chunk), str(rounds)]  # fmt: skip
    child = subprocess.Popen(cmd, cwd="/")  # not the repo root: its operator/ would shadow the stdlib's
    try:
        msg = np.arange(words, dtype=np.int64)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            ping.write(msg, timeout_s=60)
            reader.read()
            times.append((time.perf_counter() - t0) / 2)
        child.wait(60)
    finally:
        ping.unlink()
        back.unlink()
        if child.poll() is None:
            child.kill()
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenmill.engine.parallel_bench")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--pong", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pong:
        pong(args.pong[0], args.pong[1], int(args.pong[2]), int(args.pong[3]))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; tiny qwen2, fp32, CPU", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(pathlib.Path(tmp))
        for batch in args.batch:
            one, _ = step_times(model, 1, batch)
            two, inside = step_times(model, 2, batch)
            print(
                f"batch {batch:3d}: step TP=1 {one * 1e3:7.2f} ms, TP=2 {two * 1e3:7.2f} ms "
                f"(x{two / one:.2f}, +{(two - one) * 1e3:.2f} ms); rank 0 in the broadcast {inside * 1e6:.1f} us",
                flush=True,
            )
    for words in (6 + 7 * 1 + 1, 6 + 7 * 64 + 64):  # a packed decode step of batch 1 / 64, 1 block each
        print(f"ring ping-pong, {8 * words} bytes: {ping_pong(words) * 1e6:.1f} us one way", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
