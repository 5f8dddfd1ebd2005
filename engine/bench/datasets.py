"""Benchmark workloads: JSONL files and the built-in generators (random:N:IN:OUT, seed-sim[:N]).

Every request carries its exact output length; the benchmarks force it (ignore_eos) so that all
systems compared do the same work.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The seeds' simulation: 200 requests, output lengths min(1000, int(lognormvariate(4.6, 0.8))) drawn
# right after random.seed(7). Their claims (3,319 / 8,020 / 25,505 steps) are anchored to these lengths.
SEED_SIM_NUM_REQUESTS = 200
SEED_SIM_SEED = 7
SEED_SIM_MU = 4.6
SEED_SIM_SIGMA = 0.8
SEED_SIM_MAX_TOKENS = 1000
# The seeds say only "short prompts". Ours: 8..32 random token ids from a separate generator, so the
# output lengths stay exactly the seeds' draws.
SEED_SIM_PROMPT_SEED = 1007
SEED_SIM_PROMPT_LEN = (8, 32)

# nano-vllm's bench.py: lengths uniform in [100, max] and token ids uniform in [0, 10000].
RANDOM_MIN_LEN = 100
RANDOM_MAX_TOKEN_ID = 10000


@dataclass(slots=True)
class BenchRequest:
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens; only known once the prompt is tokenized."""
        if self.prompt_token_ids is None:
            raise ValueError("prompt_len needs prompt_token_ids: tokenize the requests first")
        return len(self.prompt_token_ids)


def load_requests(spec: str, seed: int = 0) -> list[BenchRequest]:
    """A dataset spec: `random:N:IN:OUT`, `seed-sim`, `seed-sim:N`, or a path to a JSONL file."""
    if spec == "seed-sim":
        return seed_sim_requests()
    if spec.startswith("seed-sim:"):
        return seed_sim_requests(_parse_count(spec))
    if spec.startswith("random:"):
        return random_requests(*_parse_random_spec(spec), seed=seed)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"dataset {spec!r} is not a file, 'seed-sim[:N]' or 'random:N:IN:OUT'")
    return parse_jsonl(path.read_text(), source=str(path))


def _parse_count(spec: str) -> int:
    text = spec.split(":", 1)[1]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"dataset {spec!r}: seed-sim:N needs a request count N >= 1, got {text!r}")
    return int(text)


def seed_sim_output_lens(num: int = SEED_SIM_NUM_REQUESTS) -> list[int]:
    """The seeds' output lengths; num > 200 continues the same stream (the first 200 are the seeds')."""
    rng = random.Random(SEED_SIM_SEED)  # same stream as random.seed(7) + random.lognormvariate
    return [
        min(SEED_SIM_MAX_TOKENS, int(rng.lognormvariate(SEED_SIM_MU, SEED_SIM_SIGMA)))
        for _ in range(num)
    ]


def seed_sim_requests(num: int = SEED_SIM_NUM_REQUESTS) -> list[BenchRequest]:
    """seed-sim (num = 200), or a longer stream of the same shape: a server's steady state, where the
    200-request run ends in a tail of a few long requests."""
    prompt_rng = random.Random(SEED_SIM_PROMPT_SEED)
    lo, hi = SEED_SIM_PROMPT_LEN
    requests = []
    for out_len in seed_sim_output_lens(num):
        ids = [prompt_rng.randint(1000, RANDOM_MAX_TOKEN_ID) for _ in range(prompt_rng.randint(lo, hi))]
        requests.append(BenchRequest(max_tokens=out_len, prompt_token_ids=ids))
    return requests


def random_requests(num: int, max_input: int, max_output: int, seed: int = 0) -> list[BenchRequest]:
    """nano-vllm's shape: input and output lengths uniform in [min(100, max), max], random token ids."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        in_len = rng.randint(min(RANDOM_MIN_LEN, max_input), max_input)
        out_len = rng.randint(min(RANDOM_MIN_LEN, max_output), max_output)
        ids = [rng.randint(0, RANDOM_MAX_TOKEN_ID) for _ in range(in_len)]
        requests.append(BenchRequest(max_tokens=out_len, prompt_token_ids=ids))
    return requests


def _parse_random_spec(spec: str) -> tuple[int, int, int]:
    parts = spec.split(":")
    if len(parts) != 4:
        raise ValueError(f"dataset {spec!r}: expected random:N:IN:OUT, e.g. random:256:1024:1024")
    try:
        num, max_in, max_out = (int(p) for p in parts[1:])
    except ValueError:
        raise ValueError(f"dataset {spec!r}: N, IN and OUT must be integers") from None
    if num < 1 or max_in < 1 or max_out < 1:
        raise ValueError(f"dataset {spec!r}: N, IN and OUT must each be at least 1")
    return num, max_in, max_out


def parse_jsonl(text: str, source: str = "<jsonl>") -> list[BenchRequest]:
    requests = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        requests.append(_request_from_json(obj, where))
    if not requests:
        raise ValueError(f"{source}: no requests (expected one JSON object per line)")
    return requests


def _request_from_json(obj: Any, where: str) -> BenchRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    max_tokens = obj.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    prompt, ids = obj.get("prompt"), obj.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) or 'prompt_token_ids' (list of ints)")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: prompt must be a non-empty string")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ints")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"{where}: prompt_token_ids must be non-negative ints, got {bad[0]!r}")
    return BenchRequest(max_tokens=max_tokens, prompt=prompt, prompt_token_ids=ids)


def tokenize_requests(requests: list[BenchRequest], tokenizer: Any) -> list[BenchRequest]:
    """Fill prompt_token_ids for text prompts (in place) so every system sees the same tokens."""
    for r in requests:
        if r.prompt_token_ids is None:
            r.prompt_token_ids = list(tokenizer(r.prompt, add_special_tokens=False)["input_ids"])
    return requests


def check_vocab(requests: list[BenchRequest], vocab_size: int) -> None:
    for i, r in enumerate(requests):
        if r.prompt_token_ids and max(r.prompt_token_ids) >= vocab_size:
            raise ValueError(
                f"request {i}: token id {max(r.prompt_token_ids)} is outside the model's vocabulary "
                f"(size {vocab_size})"
            )


def subsample(requests: list[BenchRequest], num: int) -> list[BenchRequest]:
    """Every k-th request, so a subset keeps the workload's length distribution and arrival order."""
    if num >= len(requests):
        return list(requests)
    stride = len(requests) / num
    return [requests[int(i * stride)] for i in range(num)]
