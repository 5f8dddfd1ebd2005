"""What the prefix cache's SHA-256 block keys cost: per block, and per engine step at a decode batch.

    python -m tokenmill.engine.bench.prefix_hash [--batch 64] [--block-size 16] [--steps 512]

Prints the time per block key (SHA-256 vs the Python tuple hash it replaced), the bookkeeping time per
decode step at the given batch (KVCacheManager.cache_full_blocks for every running sequence, what
EngineCore.step calls), and the admission cost of prompts of --prompt-len tokens. The old hash is
re-created here only as the yardstick.
"""

import argparse
import random
import time

from tokenmill.engine.core.kv_cache_manager import ROOT_HASH, KVCacheManager, hash_block_tokens
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams


def _per_call_s(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of five: the machine is shared
        t0 = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - t0)
    return best / n


def per_block(block_size: int, n: int = 20000) -> tuple[float, float]:
    rng = random.Random(0)
    chunks = [tuple(rng.randrange(49152) for _ in range(block_size)) for _ in range(256)]

    def sha(k: int) -> None:
        parent = ROOT_HASH
        for i in range(k):
            parent = hash_block_tokens(parent, chunks[i & 255], b"")

    def old(k: int) -> None:
        parent = None
        for i in range(k):
            parent = hash((parent, chunks[i & 255]))

    # Both include building the chunk tuple from the token list, as the cache manager does.
    return _per_call_s(sha, n), _per_call_s(old, n)


def decode_step(batch: int, block_size: int, steps: int, prompt_len: int) -> tuple[float, float]:
    """(seconds per decode step of cache_full_blocks over the batch, seconds to admit the batch's prompts)."""
    rng = random.Random(1)
    blocks_each = (prompt_len + steps) // block_size + 2
    kv = KVCacheManager(num_blocks=batch * blocks_each + 8, block_size=block_size)
    reqs = []
    t0 = time.perf_counter()
    for i in range(batch):
        tokens = [rng.randrange(49152) for _ in range(prompt_len)]
        r = Request(f"r{i}", 0, tokens, prompt_len, SamplingParams(), arrival_time=0.0)
        hits = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, prompt_len, hits)
        r.num_computed_tokens = prompt_len
        kv.cache_full_blocks(r)
        reqs.append(r)
    admit_s = time.perf_counter() - t0
    total = 0.0
    for _ in range(steps):
        for r in reqs:
            r.token_ids.append(rng.randrange(49152))
            assert kv.allocate_slots(r, 1)
        t0 = time.perf_counter()
        for r in reqs:
            r.num_computed_tokens += 1
            kv.cache_full_blocks(r)
        total += time.perf_counter() - t0
    return total / steps, admit_s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tokenmill.engine.bench.prefix_hash")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=512)
    args = ap.parse_args(argv)
    sha_s, old_s = per_block(args.block_size)
    print(f"block key, {args.block_size} tokens: SHA-256 {sha_s * 1e6:.2f} us, Python tuple hash "
          f"{old_s * 1e6:.2f} us (x{sha_s / old_s:.1f})")  # fmt: skip
    step_s, admit_s = decode_step(args.batch, args.block_size, args.steps, args.prompt_len)
    blocks_per_step = args.batch / args.block_size
    print(f"decode step at batch {args.batch}: cache_full_blocks {step_s * 1e6:.1f} us per step "
          f"(~{blocks_per_step:.0f} new full blocks per step; hashing them: {blocks_per_step * sha_s * 1e6:.1f} us "
          f"SHA-256 vs {blocks_per_step * old_s * 1e6:.1f} us tuple hash)")  # fmt: skip
    n_blocks = args.batch * (args.prompt_len // args.block_size)
    print(f"admitting {args.batch} prompts of {args.prompt_len} tokens: {admit_s * 1e3:.1f} ms for "
          f"{n_blocks} blocks (lookup + allocate + register; SHA-256 share {n_blocks * sha_s * 1e3:.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
