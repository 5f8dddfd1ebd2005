"""The engine's GPU path, once, on a lent device machine: greedy parity and throughput on random weights.

Run by engine/bench/gpu_session.sh (which also runs kernels/gpu_check.py); each phase is its own process
so that one phase's failure (or time cap) leaves the others' results:

    python engine/bench/gpu_session.py parity     --assets DIR --out OUT [--device cuda] [--tiny]
    python engine/bench/gpu_session.py throughput --assets DIR --out OUT [--device cuda] [--tiny]
    python engine/bench/gpu_session.py big        --assets DIR --out OUT [--device cuda] [--tiny]

The bundled SmolLM2-135M weights are too big to carry to the device machine, so the weights are made
there: the bundled model's config.json and tokenizer (ASSETS, a folder of small files; see
gpu_session_prep.sh) with seeded random weights, saved as an HF folder. Random weights are scaled so that
logits are far from uniform (greedy decoding does not hinge on near-ties), as tests/tiny_models.py does.
`big` uses a Llama-3.2-1B-like shape (hidden 2048, 16 layers, 32/8 heads, intermediate 8192) with the
same tokenizer's vocabulary (49152), about 1.07B parameters, for a realistic decode rate.

--tiny shrinks every shape and workload so the same code runs in seconds on a CPU (how it is tested
without a GPU). Results are merged into OUT/results.json under the phase's name, engine part first, so
that a phase cut off by its time cap still leaves what it measured.
"""

import argparse
import gc
import json
import os
import pathlib
import shutil
import sys
import time
from typing import Any

import torch

ASSET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "generation_config.json", "special_tokens_map.json")
# Llama-3.2-1B's layer shape (its vocabulary would outrun the carried tokenizer: 49152 ids kept).
BIG_SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, head_dim=64)
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, head_dim=16)
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Kubernetes schedules pods onto nodes by",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
)
GiB = 1 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record(out: pathlib.Path, phase: str, result: dict[str, Any]) -> None:
    """Merge result into out/results.json under phase (read, update, replace)."""
    path = out / "results.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[phase] = result
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(assets: pathlib.Path, dest: pathlib.Path, shape: dict[str, int] | None, dtype: torch.dtype,
               device: torch.device, seed: int = 0) -> pathlib.Path:
    """An HF Llama folder at dest: assets' config (shape overrides applied), seeded random weights made on
    device, the assets' tokenizer files. Reused when dest already holds one (a later phase)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (dest / "model.safetensors").is_file() or (dest / "model.safetensors.index.json").is_file():
        return dest
    cfg = json.loads((assets / "config.json").read_text())
    cfg.pop("model_type", None)
    cfg.update(shape or {})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    config = LlamaConfig(**cfg)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.2)  # tied: logits' spread is 0.2 * sqrt(hidden) for unit-RMS hidden states
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)  # unit gain per projection: the residual neither dies nor explodes
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ASSET_FILES:
        if name != "config.json" and (assets / name).is_file():
            shutil.copy(assets / name, tmp / name)
    tmp.replace(dest)
    n = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    log(f"made {dest}: {n / 1e6:.1f}M parameters, {dtype}, in {time.perf_counter() - t0:.1f} s")
    return dest


def load_hf(folder: pathlib.Path, dtype: torch.dtype, device: torch.device) -> Any:
    from tokenmill.engine.bench.baselines import load_hf_model

    return load_hf_model(str(folder), dtype).to(device)


def engine_llm(folder: pathlib.Path, dtype: str, device: torch.device, **kw: Any) -> Any:
    from tokenmill.engine import LLM

    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype=dtype, device=str(device), **kw)
    log(f"engine up ({dtype}, {device}) in {time.perf_counter() - t0:.1f} s: {llm.capacity}")
    return llm


def free() -> None:
    """Return the memory of objects the caller has just dropped (engine, HF model) to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from tokenmill.engine import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def hf_greedy(model: Any, prompts: list[list[int]], n: int, device: torch.device, pad: int) -> list[list[int]]:
    """One generate call per prompt (no padding in play): transformers' own greedy tokens."""
    from tokenmill.engine.bench.baselines import _greedy_exact

    got = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_exact(n, pad))
        got.append(out[0, len(p):].tolist())
    return got


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Exact matches, and the mean fraction of each output before the first differing token."""
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return {"exact": sum(x == y for x, y in zip(a, b, strict=True)), "of": len(a),
            "mean_common_prefix_fraction": sum(prefix) / len(prefix), "first_divergence": prefix}


def phase_parity(args: argparse.Namespace, device: torch.device) -> int:
    from tokenmill.engine.model.tokenizer import load_tokenizer

    shape = TINY_SHAPE if args.tiny else None
    n = 8 if args.tiny else 32
    folder = make_model(args.assets, args.models / "smol-fp32", shape, torch.float32, device)
    tok = load_tokenizer(folder)
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    pad = int(json.loads((folder / "config.json").read_text()).get("pad_token_id") or 0)
    result: dict[str, Any] = {"model": str(folder), "new_tokens": n, "prompts": len(prompts)}
    kv = {"kv_cache_memory": 2 * GiB, "max_model_len": 1024}
    rc = 0
    engine_tokens = {}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        llm = engine_llm(folder, dtype_name, device, **kv)
        ours = engine_tokens[dtype_name] = engine_greedy(llm, prompts, n)
        llm = None
        free()
        hf = load_hf(folder, dtype, device)
        theirs = hf_greedy(hf, prompts, n, device, pad)
        hf = None
        free()
        agree = agreement(ours, theirs)
        result[dtype_name] = agree
        log(f"{dtype_name}: engine vs transformers on {device}: {agree['exact']}/{agree['of']} identical, "
            f"mean common prefix {agree['mean_common_prefix_fraction']:.3f}")
        if dtype_name == "float32" and agree["exact"] != agree["of"]:
            rc = 1
            for i, (x, y) in enumerate(zip(ours, theirs, strict=True)):
                if x != y:
                    log(f"  prompt {i}: engine {x}\n              hf     {y}")
        record(args.out, "parity", result)
    # The 8-bit KV caches (Triton's fp8 / int8 paths) against the bf16 cache: reported, not a pass/fail (the
    # tolerance is docs/engine.md's, measured on CPU; a first GPU run records where CUDA lands).
    for cache in ("fp8", "int8"):
        try:
            llm = engine_llm(folder, "bfloat16", device, kv_cache_dtype=cache, **kv)
            agree = agreement(engine_greedy(llm, prompts, n), engine_tokens["bfloat16"])
        except Exception as e:  # a GPU without fp8 refuses it; the other results still count
            agree = {"error": f"{type(e).__name__}: {e}"}
        llm = None
        free()
        result[f"bfloat16_kv_{cache}"] = agree
        log(f"bf16 with a {cache} KV cache vs the bf16 cache: {agree}")
        record(args.out, "parity", result)
    log("PARITY " + ("PASS (fp32 token-for-token)" if rc == 0 else "FAIL (fp32 tokens differ)"))
    return rc


@torch.inference_mode()
def hf_batched(model: Any, prompts: list[list[int]], n: int, device: torch.device, pad: int) -> float:
    """All prompts in one generate call (equal lengths: no padding), exactly n tokens each; seconds."""
    from tokenmill.engine.bench.baselines import _greedy_exact

    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    model.generate(ids[:2], attention_mask=mask[:2], generation_config=_greedy_exact(4, pad))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, generation_config=_greedy_exact(n, pad))
    sync(device)
    seconds = time.perf_counter() - t0
    if out.shape[1] - ids.shape[1] != n:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked for {n}")
    return seconds


def throughput(args: argparse.Namespace, device: torch.device, folder: pathlib.Path, phase: str,
               num: int, prompt_len: int, n: int, kv_bytes: int) -> int:
    """Engine bf16 offline (all requests at once) vs one batched transformers generate, same prompts."""
    import random

    from tokenmill.engine.bench.datasets import BenchRequest
    from tokenmill.engine.bench.throughput import run_engine, throughput_report, warm_up

    cfg = json.loads((folder / "config.json").read_text())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(prompt_len)] for _ in range(num)]
    requests = [BenchRequest(max_tokens=n, prompt_token_ids=p) for p in prompts]
    result: dict[str, Any] = {"model": str(folder), "requests": num, "prompt_len": prompt_len, "new_tokens": n}
    llm = engine_llm(folder, "bfloat16", device, kv_cache_memory=kv_bytes, max_model_len=1024)
    warm_up(llm)
    seconds, _, _ = run_engine(llm, requests, use_tqdm=False)
    stats = llm.stats()
    result["engine"] = throughput_report(requests, seconds, stats, "bfloat16", int(stats["max_num_seqs"]))
    log(f"engine bf16: {num} x {n} tokens in {seconds:.2f} s = {result['engine']['tokens_per_s']:.0f} tok/s "
        f"({result['engine']['num_steps']} steps)")
    one = [BenchRequest(max_tokens=n, prompt_token_ids=prompts[0])]
    s1, _, _ = run_engine(llm, one, use_tqdm=False)
    result["engine_batch1_tokens_per_s"] = n / s1
    log(f"engine bf16, one request: {n} tokens in {s1:.2f} s = {n / s1:.0f} tok/s")
    record(args.out, phase, result)
    llm = None
    free()
    pad = int(cfg.get("pad_token_id") or 0)
    hf = load_hf(folder, torch.bfloat16, device)
    hs = hf_batched(hf, prompts, n, device, pad)
    result["hf_batched"] = {"seconds": hs, "tokens_per_s": num * n / hs}
    result["engine_over_hf"] = result["engine"]["tokens_per_s"] / result["hf_batched"]["tokens_per_s"]
    log(f"transformers bf16 batched generate: {num} x {n} in {hs:.2f} s = {num * n / hs:.0f} tok/s; "
        f"engine / transformers = {result['engine_over_hf']:.2f}x")
    record(args.out, phase, result)
    return 0


def phase_throughput(args: argparse.Namespace, device: torch.device) -> int:
    shape = TINY_SHAPE if args.tiny else None
    folder = make_model(args.assets, args.models / "smol-fp32", shape, torch.float32, device)
    num, plen, n = (8, 8, 8) if args.tiny else (256, 32, 128)
    return throughput(args, device, folder, "throughput", num, plen, n, 4 * GiB)


def phase_big(args: argparse.Namespace, device: torch.device) -> int:
    shape = TINY_SHAPE if args.tiny else BIG_SHAPE
    folder = make_model(args.assets, args.models / "llama-1b-bf16", shape, torch.bfloat16, device)
    num, plen, n = (8, 8, 8) if args.tiny else (256, 128, 128)
    return throughput(args, device, folder, "big", num, plen, n, 16 * GiB)


PHASES = {"parity": phase_parity, "throughput": phase_throughput, "big": phase_big}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=sorted(PHASES))  # after the options too: argparse takes either order
    ap.add_argument("--assets", type=pathlib.Path, required=True,
                    help="folder with the bundled model's config.json and tokenizer files")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="results.json goes here")
    ap.add_argument("--models", type=pathlib.Path, default=pathlib.Path("/tmp/gpu_session_models"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and workloads (a CPU test of this script)")
    args = ap.parse_args(argv)
    if not (args.assets / "config.json").is_file() or not (args.assets / "tokenizer.json").is_file():
        print(f"gpu_session: {args.assets} lacks config.json/tokenizer.json (run engine/bench/gpu_session_prep.sh)")
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_session: no CUDA device visible (torch.cuda.is_available() is False); use --device cpu --tiny")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    log(f"phase {args.phase} on {device}; torch {torch.__version__}; python {sys.version.split()[0]}; "
        f"pid {os.getpid()}")
    return PHASES[args.phase](args, device)


if __name__ == "__main__":
    sys.exit(main())
