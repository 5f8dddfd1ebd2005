"""Hugging Face Transformers baselines for `bench compare`, on the same weights, dtype and workload.

All requests arrive at time 0 in dataset order; a request's completion time is when its tokens are
available to its caller (a static batch returns all its members together when its longest finishes).
Outputs are forced to each request's max_tokens, as in the engine run.
"""

import logging
import pathlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenmill.engine.bench.datasets import BenchRequest
from tokenmill.engine.kv_memory import blocks_for_tokens


@dataclass(slots=True)
class SystemResult:
    name: str
    requests: int
    generated_tokens: int  # useful tokens only: what the requests asked for
    seconds: float
    completion_times: list[float] = field(default_factory=list)
    note: str = ""
    # Process CPU time of the run (all threads). With one torch thread it equals the wall time on an idle
    # machine, and it barely moves when other jobs take the cores, so ratios by CPU time survive sharing.
    cpu_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.generated_tokens / self.cpu_seconds if self.cpu_seconds else float("nan")


def load_hf_model(model_dir: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # transformers' CB logs a psutil complaint on every CPU run; it changes nothing here.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    gguf = pathlib.Path(model_dir) / "model.gguf"
    if gguf.exists():  # a GGUF's folder holds no weights transformers reads: its fp32 dequantized copy does
        from tokenmill.engine.model.gguf_cache import dequantized_copy_cached

        model_dir = str(dequantized_copy_cached(gguf.resolve()))
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _greedy_exact(n: int, pad_token_id: int) -> Any:
    from transformers import GenerationConfig

    # min_new_tokens == max_new_tokens suppresses EOS: transformers' equivalent of ignore_eos.
    return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_token_id,
                            eos_token_id=None)


@torch.inference_mode()
def run_naive(model: Any, requests: list[BenchRequest], pad_token_id: int = 0, progress: bool = True
              ) -> SystemResult:
    """The seeds' naive server: one `generate` call per request, in arrival order."""
    t0 = time.perf_counter()
    done = []
    for i, r in enumerate(requests):
        ids = torch.tensor([r.prompt_token_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             generation_config=_greedy_exact(r.max_tokens, pad_token_id))
        _check_len(out.shape[1] - ids.shape[1], r.max_tokens, f"naive request {i}")
        done.append(time.perf_counter() - t0)
        if progress:
            print(f"  naive {i + 1}/{len(requests)}: {r.max_tokens} tokens at {done[-1]:.1f}s", flush=True)
    return SystemResult("hf naive (1 at a time)", len(requests), sum(r.max_tokens for r in requests),
                        done[-1], done)


@torch.inference_mode()
def run_static(model: Any, requests: list[BenchRequest], batch_size: int, pad_token_id: int = 0,
               progress: bool = True) -> SystemResult:
    """Static batches in arrival order, left-padded, each run to its longest member."""
    t0 = time.perf_counter()
    done = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.max_tokens for r in batch)
        out = model.generate(ids, attention_mask=mask, generation_config=_greedy_exact(longest, pad_token_id))
        _check_len(out.shape[1] - width, longest, f"static batch at {start}")
        done.extend([time.perf_counter() - t0] * len(batch))
        if progress:
            print(f"  static batch {start // batch_size + 1}/{-(-len(requests) // batch_size)}: "
                  f"{len(batch)} x {longest} tokens at {done[-1]:.1f}s", flush=True)
    return SystemResult(f"hf static batches of {batch_size}", len(requests),
                        sum(r.max_tokens for r in requests), done[-1], done)


@torch.inference_mode()
def run_hf_continuous(model: Any, requests: list[BenchRequest], max_num_seqs: int, block_size: int,
                      max_batch_tokens: int, progress: bool = True) -> SystemResult:
    """transformers' own continuous batching (the manager behind `generate_batch`), with the same
    request cap and page size as our engine and enough KV blocks that it never has to evict."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    num_blocks = max_num_seqs * blocks_for_tokens(longest, block_size) + 1
    cb_config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks,
                                         max_batch_tokens=max_batch_tokens,
                                         max_requests_per_batch=max_num_seqs)
    gen_config = GenerationConfig(max_new_tokens=max(r.max_tokens for r in requests), do_sample=False,
                                  eos_token_id=-1, pad_token_id=0)
    finished: dict[str, float] = {}
    with model.continuous_batching_context_manager(generation_config=gen_config,
                                                   continuous_batching_config=cb_config,
                                                   warmup=False) as manager:
        t0 = time.perf_counter()
        ids = [manager.add_request(list(r.prompt_token_ids), request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                   eos_token_id=-1) for i, r in enumerate(requests)]
        while len(finished) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers CB request {result.request_id} failed: {result.error}")
                i = int(result.request_id[1:])
                _check_len(len(result.generated_tokens), requests[i].max_tokens, f"hf cb request {i}")
                finished[result.request_id] = time.perf_counter() - t0
                if progress and len(finished) % max(1, len(ids) // 10) == 0:
                    print(f"  hf cb: {len(finished)}/{len(ids)} done at {finished[result.request_id]:.1f}s",
                          flush=True)
    times = [finished[i] for i in ids]
    return SystemResult(f"hf continuous batching ({max_num_seqs} seqs)", len(requests),
                        sum(r.max_tokens for r in requests), max(times), times)


def _check_len(got: int, want: int, what: str) -> None:
    if got != want:
        raise RuntimeError(f"{what}: expected exactly {want} new tokens, got {got}")
