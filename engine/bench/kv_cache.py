"""`tokenmill bench kv-cache`: the 8-bit KV caches against the model's-dtype cache, in one process.

For each --kv-cache-dtype given (the first is the baseline, `auto` by default), one engine with the same
KV memory: its pool (blocks, bytes per token), its greedy parity with the baseline on fixed prompts
(`greedy_parity`), and its pure decode step time at each batch and prompt length (interleaved rounds,
best kept; ratios against the baseline from the same rounds).

Parity, vLLM's check_logprobs_close idea: walk each prompt's greedy tokens in step; while they agree the
contexts are identical, so the chosen token's logprob difference measures the cache's error alone; at
the first disagreement each run's token must be in the other's top-k, and the walk stops there.
"""

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

# Plain text and chat-shaped prompts of a few kinds (story, facts, code, lists, dialogue): greedy output of
# a 135M model diverges early on some of them whatever the cache, which is what the tolerance must survive.
PARITY_PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1492, Columbus",
    "The three primary colors are",
    "Here is a recipe for pancakes:",
    "Water boils at",
    "import numpy as np\n\ndef normalize(x):",
    "The best way to learn a new language is",
    "Q: What is the largest planet in the solar system?\nA:",
    "List of prime numbers: 2, 3, 5,",
    "Dear hiring manager,",
    "The theory of relativity states that",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, age FROM users WHERE",
]


@dataclass(slots=True)
class Parity:
    prompts: int
    identical: int  # prompts whose greedy tokens are equal at every step
    compared_steps: int  # steps with identical contexts (up to and including each first disagreement)
    max_abs_logprob_diff: float  # of the token both chose, over the compared steps where they agree
    mean_abs_logprob_diff: float
    first_divergence: list[int | None]  # per prompt: the step where the tokens first differ
    divergent_in_top_k: bool  # at every first disagreement, each run's token is in the other's top-k


def greedy_parity(reference: list[Any], test: list[Any]) -> Parity:
    """Compare two runs (lists of RequestOutput, logprobs >= 1) of the same prompts, greedy."""
    diffs: list[float] = []
    first: list[int | None] = []
    in_top = True
    compared = 0
    for ref, out in zip(reference, test, strict=True):
        a, b = ref.outputs[0], out.outputs[0]
        div = None
        for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
            compared += 1
            if ta != tb:
                div = step
                in_top = in_top and ta in b.logprobs[step] and tb in a.logprobs[step]
                break
            diffs.append(abs(a.logprobs[step][ta] - b.logprobs[step][tb]))
        if div is None and len(a.token_ids) != len(b.token_ids):
            div = min(len(a.token_ids), len(b.token_ids))  # one stopped (EOS) where the other did not
        first.append(div)
    return Parity(
        prompts=len(reference),
        identical=sum(d is None for d in first),
        compared_steps=compared,
        max_abs_logprob_diff=max(diffs, default=0.0),
        mean_abs_logprob_diff=sum(diffs) / len(diffs) if diffs else 0.0,
        first_divergence=first,
        divergent_in_top_k=in_top,
    )


def generate_greedy(llm: Any, prompts: list[str], max_tokens: int, top_k: int = 5) -> list[Any]:
    from tokenmill.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top_k)
    return llm.generate(prompts, params, use_tqdm=False)


def decode_step_seconds(llm: Any, batch: int, prompt_len: int, short: int, long: int) -> tuple[float, float]:
    """(wall, CPU) seconds per pure decode step at `batch` sequences after `prompt_len`-token prompts: two
    runs that differ only in output length, so prefill and start-up cancel (bench/roofline.py's method).
    CPU time is this process's: on a shared machine it leaves out the time other jobs held the cores."""
    from tokenmill.engine import SamplingParams

    prompts = [[1000 + 7 * i + j for j in range(prompt_len)] for i in range(batch)]

    def run(n: int) -> tuple[float, float, int]:
        llm.reset_stats()
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate(None, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
                     prompt_token_ids=prompts, use_tqdm=False)  # fmt: skip
        return time.perf_counter() - t0, time.process_time() - c0, int(llm.stats()["num_steps"])

    w_short, c_short, s_short = run(short)
    w_long, c_long, s_long = run(long)
    steps = max(1, s_long - s_short)
    # At or below zero the two runs' prefills differed by more than the extra decode steps took (a busy
    # machine, long prompts): no step time was measured, so inf, which the rounds' minimum passes over.
    wall, cpu = (w_long - w_short) / steps, (c_long - c_short) / steps
    return (wall if wall > 0 else math.inf), (cpu if cpu > 0 else math.inf)


def run_kv_cache_bench(
    llm_kwargs: dict[str, Any],
    kv_cache_dtypes: list[str],
    batches: list[int],
    prompt_lens: list[int],
    rounds: int,
    parity_tokens: int,
    short: int = 4,
    long: int = 20,
) -> dict[str, Any]:
    from tokenmill.engine import LLM

    # No prefix caching: both runs of a measurement prefill their prompts, so the difference is decode alone.
    llms = {d: LLM(**{**llm_kwargs, "enable_prefix_caching": False}, kv_cache_dtype=d) for d in kv_cache_dtypes}
    base = kv_cache_dtypes[0]
    caps = {d: llm.capacity for d, llm in llms.items()}
    report: dict[str, Any] = {
        "model_dtype": caps[base].dtype,
        "kv_cache_memory": llm_kwargs.get("kv_cache_memory"),
        "capacity": {
            d: {
                "cache": c.kv_cache_dtype_resolved,
                "kv_blocks": c.num_kv_blocks,
                "kv_bytes_per_token": c.kv_bytes_per_token,
                "blocks_vs_" + base: round(c.num_kv_blocks / caps[base].num_kv_blocks, 3),
            }
            for d, c in caps.items()
        },
    }
    reference = generate_greedy(llms[base], PARITY_PROMPTS, parity_tokens)
    report["parity"] = {
        d: asdict(greedy_parity(reference, generate_greedy(llm, PARITY_PROMPTS, parity_tokens)))
        for d, llm in llms.items() if d != base
    }  # fmt: skip
    for llm in llms.values():  # warm: each engine's first decode steps at the largest batch
        decode_step_seconds(llm, max(batches), min(prompt_lens), 2, 4)
    wall = {(d, b, p): float("inf") for d in llms for b in batches for p in prompt_lens}
    cpu = dict(wall)
    for _ in range(rounds):
        for b in batches:
            for p in prompt_lens:
                for d, llm in llms.items():
                    w, c = decode_step_seconds(llm, b, p, short, long)
                    wall[d, b, p], cpu[d, b, p] = min(wall[d, b, p], w), min(cpu[d, b, p], c)
    report["decode_steps"] = [
        {
            "batch": b, "prompt_len": p, "mean_context": p + (short + long) / 2,
            **{f"{d}_ms": _ms(wall[d, b, p]) for d in llms},
            **{f"{d}_speedup": _ratio(wall[base, b, p], wall[d, b, p]) for d in llms if d != base},
            **{f"{d}_cpu_ms": _ms(cpu[d, b, p]) for d in llms},
            **{f"{d}_cpu_speedup": _ratio(cpu[base, b, p], cpu[d, b, p]) for d in llms if d != base},
        }
        for b in batches for p in prompt_lens
    ]  # fmt: skip
    return report


def _ms(seconds: float) -> float | None:
    """Milliseconds, or None where no round measured a step (decode_step_seconds gave inf every time)."""
    return round(seconds * 1e3, 2) if math.isfinite(seconds) else None


def _ratio(base: float, other: float) -> float | None:
    return round(base / other, 3) if math.isfinite(base) and math.isfinite(other) else None
