"""The machine's measured ceilings (matmul FLOP/s, memory bandwidth) and how close a decode step gets.

A decode step of batch B must read every weight once and each sequence's KV cache, and do about
2 FLOPs per weight per token plus attention; its roofline time is the larger of bytes / bandwidth and
FLOPs / peak. The fraction reported is roofline time / measured step time.
"""

import json
import time
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _best_time(fn: Any, reps: int) -> float:
    fn()  # warm: first call pays for allocation and kernel selection
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of an n x n x n torch matmul (best of reps: the machine is shared, noise only slows)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), reps)


def copy_bandwidth(megabytes: int = 256, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src), reps)


def model_shape(model_dir: str, dtype: str = "bfloat16") -> dict[str, int]:
    """Parameter count (from the safetensors headers, or a GGUF's) and the attention shape (from
    config.json), with weight_bytes where a step reads other than params x the dtype's bytes: a GGUF's
    codes, or a bf16 checkpoint served in fp32 on the fp32 kernel's bf16 panels (quant_memory's count)."""
    from safetensors import safe_open
    from tokenmill.engine.quant_memory import config_weights, gguf_weights
    from tokenmill.kernels.cpu_probe import probe

    params = 0
    extra: dict[str, int] = {}
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    gguf = Path(model_dir) / "model.gguf"  # a GGUF's cache folder (model/gguf_cache.py): the weights as codes
    if gguf.exists():
        from tokenmill.engine.gguf_header import read_gguf_header

        held = gguf_weights(read_gguf_header(gguf).tensors, dtype)
        params, extra["weight_bytes"] = held.parameters, held.loaded_bytes
    elif dtype == "float32" and probe().at_least("avx2") and (cfg.get("torch_dtype") or cfg.get("dtype")) == "bfloat16":
        extra["weight_bytes"] = config_weights(cfg, dtype, codes=True).loaded_bytes
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                params += n
    num_heads = cfg["num_attention_heads"]
    return {
        "params": params,
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": cfg.get("num_key_value_heads", num_heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        **extra,
    }


def decode_step_cost(shape: dict[str, int], batch: int, context: float, dtype: str) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step: `batch` sequences, each attending over `context` tokens.

    Weights are read once per step (tied embeddings count once: the LM head reads the whole table);
    attention does QK^T and PV over the context for every query head; KV is K and V per layer.
    """
    from tokenmill.engine.kv_memory import dtype_bytes, kv_bytes_per_token

    flops = 2.0 * shape["params"] * batch
    flops += 4.0 * batch * context * shape["num_heads"] * shape["head_dim"] * shape["num_layers"]
    kv_token = kv_bytes_per_token(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], dtype)
    weights = shape.get("weight_bytes", shape["params"] * dtype_bytes(dtype))  # codes: quant_memory's count
    nbytes = float(weights + batch * context * kv_token)
    return flops, nbytes


def roofline_fraction(flops: float, nbytes: float, seconds: float, peak_flops: float, bandwidth: float
                      ) -> dict[str, float]:
    bound = max(flops / peak_flops, nbytes / bandwidth)
    return {
        "step_ms": seconds * 1000,
        "roofline_ms": bound * 1000,
        "bound_by": "memory" if nbytes / bandwidth >= flops / peak_flops else "compute",
        "achieved_gflops": flops / seconds / 1e9,
        "achieved_gbytes_per_s": nbytes / seconds / 1e9,
        "fraction_of_roofline": bound / seconds,
    }


def measure_decode_step(llm: Any, batch: int, prompt_len: int = 16, short: int = 16, long: int = 80
                        ) -> tuple[float, float]:
    """Seconds per pure decode step at `batch` sequences, and the mean context over those steps.

    Two runs differing only in output length; their difference cancels prefill and start-up costs.
    """
    from tokenmill.engine import SamplingParams

    prompts = [[1000 + 7 * i + j for j in range(prompt_len)] for i in range(batch)]

    def run(n: int) -> tuple[float, int]:
        llm.reset_stats()
        t0 = time.perf_counter()
        llm.generate(None, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
                     prompt_token_ids=prompts, use_tqdm=False)
        return time.perf_counter() - t0, int(llm.stats()["num_steps"])

    run(4)  # warm-up
    t_short, s_short = run(short)
    t_long, s_long = run(long)
    if s_long <= s_short:
        raise RuntimeError(f"decode step measurement: {s_long} steps for {long} tokens, {s_short} for {short}")
    return (t_long - t_short) / (s_long - s_short), prompt_len + (short + long) / 2


def profile_decode(llm: Any, batch: int, path: str, prompt_len: int = 16, tokens: int = 32, rows: int = 30) -> None:
    """torch.profiler over `tokens` decode steps at `batch` sequences; writes the op table by self CPU time."""
    from tokenmill.engine import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    prompts = [[2000 + 11 * i + j for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    Path(path).write_text(f"decode profile: batch {batch}, prompt {prompt_len}, {tokens} tokens each\n{table}\n")
