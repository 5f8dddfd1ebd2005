"""`python -m tokenmill.engine.bench.load_peak`: peak memory while a model's weights load, against the
bound the loader promises (engine/load_memory.py): final weights + the largest tensor + a fixed margin.

Each measurement runs in a fresh child process so that its RSS holds nothing but the interpreter, torch
and the model: the child imports everything, resets its peak RSS (/proc/self/clear_refs), loads the
weights the way the worker does (plan_weights, load_model, prepare_weights) and reports the kernel's
exact peak (VmHWM) and, from a thread sampling /proc/self/status every millisecond, the split of the
peak into anonymous memory and mapped file pages. Without --model it first writes a random Llama of
about 300M parameters (--preset) in fp32 and in bf16 under a temporary folder and measures each served
in bf16 (and the fp32 one in fp32 with --fp32).

  python -m tokenmill.engine.bench.load_peak                      # ~300M params, fp32 and bf16 files
  python -m tokenmill.engine.bench.load_peak --model DIR --dtype bfloat16
  python -m tokenmill.engine.bench.load_peak --model FILE.gguf     # quantized weights loaded as codes
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# hidden, intermediate, layers, heads, kv heads, vocab: "300m" is 297M parameters (1.19 GB in fp32).
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "300m": (1024, 2816, 18, 16, 16, 32000),
    "small": (512, 1408, 8, 8, 8, 16000),  # 42M (168 MB in fp32): tests/test_load_streaming.py's
}
SAMPLE_S = 0.001


def _status_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0])
    return out


def write_checkpoint(folder: pathlib.Path, preset: str, dtype: str, seed: int = 0) -> pathlib.Path:
    """A random Llama HF folder (config.json + model.safetensors) written one tensor at a time, so that
    writing a model bigger than memory's spare room works too."""
    import torch
    from tokenmill.engine.model.safetensors_stream import write_safetensors

    hidden, inter, layers, heads, kv_heads, vocab = PRESETS[preset]
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": dtype,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })  # fmt: skip
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def tensor(name: str) -> torch.Tensor:
        shape = shapes[name]
        if len(shape) == 1:
            return (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch_dtype)
        return (0.02 * torch.randn(shape, generator=gen)).to(torch_dtype)

    path = folder / "model.safetensors"
    write_safetensors(path, {k: (torch_dtype, s) for k, s in shapes.items()}, tensor)
    return path


def _resident_weight_bytes(model: Any) -> int:
    """Bytes of every tensor the loaded model keeps (parameters, buffers, packed and code forms), each
    storage once."""
    import torch
    from tokenmill.engine.layers.grouped_codes import CodesEmbedding, GroupedPackedWeight, SplitPackedWeight
    from tokenmill.engine.layers.linear import CpuPackedWeight

    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if isinstance(t, torch.Tensor):
            if t.is_mkldnn:
                seen[id(t)] = t.numel() * t.element_size()
            else:
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        elif isinstance(t, CpuPackedWeight):
            for part in (t.fp32, t.codes, t.scales, t.mins, t.dense):
                add(part)
        elif isinstance(t, GroupedPackedWeight):
            for part in (t.lo, t.hi, t.sc, t.mn, t.d, t.dmin):
                add(part)
        elif isinstance(t, SplitPackedWeight):
            for part in t.parts:
                add(part)
        elif isinstance(t, CodesEmbedding):
            add(t.packed)

    for module in model.modules():
        for value in list(module._parameters.values()) + list(module._buffers.values()) + list(vars(module).values()):
            add(value)
    return sum(seen.values())


def child(model_dir: str, dtype_name: str) -> dict[str, Any]:
    """Load as the worker does, in this process; the peak and what it is measured against."""
    import torch
    from tokenmill.engine import load_memory
    from tokenmill.engine.gguf_header import read_gguf_header
    from tokenmill.engine.model.loader import load_model
    from tokenmill.engine.model.resolve import resolve_model
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.worker.cpu_weights import (
        loading_hooks,
        plan_weights,
        prepare_weights,
        release_freed_memory,
    )
    from tokenmill.kernels import cpu as cpu_kernels

    path = resolve_model(model_dir)  # a .gguf: its cache folder (config, tokenizer, a link to the file)
    dtype, device = getattr(torch, dtype_name), torch.device("cpu")
    config = load_model_config(path)
    cpu_kernels.load()  # the kernels' build and import are not the load's memory
    plan = plan_weights(device, dtype, path, 1)
    release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now (Linux >= 4.0)
    base = _status_kib()
    peak = dict(base)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = _status_kib()
            if now["VmRSS"] > peak["VmRSS"]:
                peak.update(now)
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = load_model(path, config, plan.load_dtype, device, fp32_hooks=lambda m: loading_hooks(m, device, dtype, plan))
    prepare_weights(model, device, dtype, plan, streamed=True)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    end = _status_kib()
    if (path / "model.gguf").exists():
        tensors = read_gguf_header(path / "model.gguf").tensors
        kinds = sorted({t.type_name for t in tensors})
    else:
        tensors = load_memory.checkpoint_tensors(path)
        kinds = sorted({t.dtype for t in tensors})
    largest = max(t.nbytes for t in tensors)
    final = _resident_weight_bytes(model)
    kib = 1024
    return {
        "model": str(path), "dtype": dtype_name, "plan_load_dtype": str(plan.load_dtype).removeprefix("torch."),
        "keep_codes": plan.keep_codes, "checkpoint_bytes": sum(t.nbytes for t in tensors),
        "checkpoint_dtypes": kinds, "largest_tensor_bytes": largest,
        "final_weights_bytes": final, "baseline_rss_bytes": base["VmRSS"] * kib,
        "peak_delta_bytes": (end["VmHWM"] - base["VmRSS"]) * kib,
        "peak_delta_anon_bytes": (peak["RssAnon"] - base["RssAnon"]) * kib,
        "peak_delta_file_bytes": (peak["RssFile"] - base["RssFile"]) * kib,
        "end_delta_bytes": (end["VmRSS"] - base["VmRSS"]) * kib,
        "bound_bytes": load_memory.load_peak_bound_bytes(final, largest),
        "margin_bytes": load_memory.LOAD_MARGIN_BYTES, "load_seconds": round(seconds, 2),
    }  # fmt: skip


def measure(model_dir: str | pathlib.Path, dtype: str) -> dict[str, Any]:
    """child() in a fresh interpreter (one thread: the load is not what threads speed up here)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.bench.load_peak", "--child", str(model_dir), "--dtype", dtype],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"load_peak child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f} MB"


def report(r: dict[str, Any]) -> str:
    ok = "within" if r["peak_delta_bytes"] <= r["bound_bytes"] else "OVER"
    return "\n".join([
        f"{r['model']} ({'/'.join(r['checkpoint_dtypes'])}, {_mb(r['checkpoint_bytes']).strip()}) served in "
        f"{r['dtype']} (read as {r['plan_load_dtype']}{', codes kept' if r['keep_codes'] else ''}), {r['load_seconds']} s",
        f"  peak RSS over baseline {_mb(r['peak_delta_bytes'])}  (anon {_mb(r['peak_delta_anon_bytes']).strip()}, "
        f"file {_mb(r['peak_delta_file_bytes']).strip()} at the sampled peak)",
        f"  after the load         {_mb(r['end_delta_bytes'])}",
        f"  final weights          {_mb(r['final_weights_bytes'])}",
        f"  largest tensor         {_mb(r['largest_tensor_bytes'])}",
        f"  bound (+{r['margin_bytes'] >> 20} MiB margin) {_mb(r['bound_bytes'])}  -> {ok}",
        f"  peak / checkpoint      {r['peak_delta_bytes'] / r['checkpoint_bytes']:8.2f} x",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.engine.bench.load_peak", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="an HF folder or .gguf file to measure (default: write random ones under a temp dir)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"], help="served dtype")
    p.add_argument("--preset", default="300m", choices=sorted(PRESETS), help="size of the random model")
    p.add_argument("--fp32", action="store_true", help="also serve the fp32 file in fp32")
    p.add_argument("--json", action="store_true", help="print one JSON object per measurement")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dtype)))
        return 0
    runs: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-load-peak-") as tmp:
        if args.model:
            runs.append((args.model, args.dtype))
        else:
            for ckpt in ("float32", "bfloat16"):
                write_checkpoint(pathlib.Path(tmp) / ckpt, args.preset, ckpt)
                runs.append((str(pathlib.Path(tmp) / ckpt), "bfloat16"))
            if args.fp32:
                runs.append((str(pathlib.Path(tmp) / "float32"), "float32"))
        for model_dir, dtype in runs:
            r = measure(model_dir, dtype)
            print(json.dumps(r) if args.json else report(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
