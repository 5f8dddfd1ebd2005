"""`tokenmill bench peers`: tokenmill, vLLM's CPU build and llama.cpp's server, one after another on this
machine, same model, same client, one table with ratios (docs/benchmarks.md, peers.md).

The pure part (this module's top half) turns each client run's JSON into one row and the rows into a
table of tokenmill's ratio to every peer; tests check it against hand-written results. The driver
(bottom half) installs the peers with engine/bench/peer_install/install_*.sh (cached under ~/.cache/tokenmill,
keyed by version), starts one server at a time, runs the clients and stops it.
"""

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# tokenmill-int8: tokenmill with --int8-activations (integer-code weights times int8-rounded activations,
# llama.cpp's arithmetic; not bit-exact with the fp32 model), beside the exact default.
ENGINES = ("tokenmill", "tokenmill-int8", "vllm", "llama.cpp")


@dataclass(slots=True)
class PeerRow:
    engine: str
    client: str  # "vllm bench serve" | "tokenmill bench serve"
    workload: str  # e.g. "random 128/128", "shared prefix 512 + 128/128"
    concurrency: int
    output_tok_s: float
    median_tpot_ms: float
    median_ttft_ms: float
    completed: int
    failed: int
    model: str = "bundled"  # PeerModel.name: "bundled", "dense-bf16", or a path's file or folder name


def row_from_result(
    engine: str, client: str, workload: str, concurrency: int, result: dict[str, Any], model: str = "bundled"
) -> PeerRow:
    """One client run's JSON as a row: `vllm bench serve --save-result` writes flat `*_ms` keys,
    `tokenmill bench serve --json` nests them (`tpot.median_ms`)."""
    if client == "vllm bench serve":
        tpot, ttft = result["median_tpot_ms"], result["median_ttft_ms"]
    elif client == "tokenmill bench serve":
        tpot, ttft = result["tpot"]["median_ms"], result["ttft"]["median_ms"]
    else:
        raise ValueError(f"unknown client {client!r}")
    return PeerRow(
        engine, client, workload, concurrency, float(result["output_throughput"]), float(tpot), float(ttft),
        int(result["completed"]), int(result.get("failed", 0)), model,
    )  # fmt: skip


def ratio_table(rows: list[PeerRow], reference: str = "tokenmill") -> list[dict[str, Any]]:
    """One line per (model, client, workload, concurrency): each engine's output tok/s and median TPOT, and
    reference / peer for throughput (above 1: the reference is faster) and peer / reference for TPOT
    (above 1: the reference's tokens come faster). A ratio is None where either side is missing or
    made no tokens."""
    keys: list[tuple[str, str, str, int]] = []
    by_key: dict[tuple[str, str, str, int], dict[str, PeerRow]] = {}
    for r in rows:
        k = (r.model, r.client, r.workload, r.concurrency)
        if k not in by_key:
            keys.append(k)
            by_key[k] = {}
        by_key[k][r.engine] = r
    table = []
    for k in keys:
        line: dict[str, Any] = {"model": k[0], "client": k[1], "workload": k[2], "concurrency": k[3]}
        engines = by_key[k]
        ref = engines.get(reference)
        for name, r in engines.items():
            line[name] = {"output_tok_s": r.output_tok_s, "median_tpot_ms": r.median_tpot_ms,
                          "completed": r.completed, "failed": r.failed}
            if name == reference:
                continue
            ok = ref is not None and r.output_tok_s > 0 and ref.output_tok_s > 0
            line[f"{reference}/{name} tok/s"] = ref.output_tok_s / r.output_tok_s if ok else None
            ok_t = ref is not None and ref.median_tpot_ms > 0 and not math.isnan(r.median_tpot_ms)
            line[f"{name}/{reference} tpot"] = r.median_tpot_ms / ref.median_tpot_ms if ok_t else None
        table.append(line)
    return table


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def markdown(table: list[dict[str, Any]], reference: str = "tokenmill") -> str:
    """The table as markdown: tok/s (TPOT ms) per engine, then the throughput ratios."""
    engines = [e for e in ENGINES if any(e in line for line in table)]
    peers = [e for e in engines if e != reference]
    head = ["model", "client", "workload", "concurrency", *[f"{e} tok/s (TPOT ms)" for e in engines],
            *[f"{reference} / {p}" for p in peers]]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for line in table:
        cells = [line["model"], line["client"], line["workload"], str(line["concurrency"])]
        for e in engines:
            v = line.get(e)
            failed = f", {v['failed']} failed" if v and v["failed"] else ""
            cells.append(f"{_fmt(v['output_tok_s'], 1)} ({_fmt(v['median_tpot_ms'], 1)}{failed})" if v else "-")
        cells += [_fmt(line.get(f"{reference}/{p} tok/s"), 2) for p in peers]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


@dataclass(slots=True)
class WeightsRead:
    """The weight bytes an engine holds for a model: what a batch-1 decode step reads (a tied embedding
    once, as the LM head), so a 4-bit engine is never compared with a 16-bit one unseen."""

    engine: str
    model: str
    weight_bytes: int
    parameters: int
    format: str  # e.g. "bfloat16", "Q4_1/Q8_0 codes (bfloat16)", "GGUF Q4_1/Q8_0"

    @property
    def bytes_per_weight(self) -> float:
        return self.weight_bytes / max(1, self.parameters)


def weights_markdown(weights: list[WeightsRead]) -> str:
    """One line per (model, engine): bytes held (MB) and per weight, and the format."""
    out = ["| model | engine | weights read per decode step | bytes per weight | as |", "|" + " --- |" * 5]
    for w in weights:
        out.append(f"| {w.model} | {w.engine} | {w.weight_bytes / 1e6:,.0f} MB | {w.bytes_per_weight:.3f} | {w.format} |")
    return "\n".join(out) + "\n"


def plot(table: list[dict[str, Any]], path: str, title: str) -> None:
    """Output tok/s per engine for each (workload, concurrency), vLLM's client rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [t for t in table if t["client"] == "vllm bench serve"] or table
    engines = [e for e in ENGINES if any(e in t for t in lines)]
    labels = [f"{t['model']}\n{t['workload']}\nc={t['concurrency']}" for t in lines]
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(lines)), 4))
    for j, e in enumerate(engines):
        ys = [t[e]["output_tok_s"] if e in t else 0.0 for t in lines]
        ax.bar([i + j * width for i in range(len(lines))], ys, width, label=e)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(lines))], labels, fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the driver (needs the peers installed; not part of make test) --------------------------------
HERE = Path(__file__).parent / "peer_install"


@dataclass(slots=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    prefix_len: int = 0  # tokens every request shares (vLLM's --random-prefix-len)


WORKLOADS = {"random": Workload("random 128/128", 128, 128),
             "prefix": Workload("shared prefix 512 + 128/128", 128, 128, 512)}  # fmt: skip
CLIENTS = ("vllm", "tokenmill")


@dataclass(slots=True)
class PeerModel:
    """One model every engine serves in turn."""

    name: str  # "bundled", "dense-bf16" or the file or folder name of the path given
    hf_dir: str  # the Hugging Face folder vLLM serves; every client reads its tokenizer
    serve: str  # what tokenmill serves: a GGUF file or a folder
    gguf: str | None  # what llama.cpp serves; None: no GGUF of this model, llama.cpp sits it out


def install(script: str) -> str:
    """Run an install script (cached: a second run returns at once) and return what it prints last."""
    out = subprocess.run(["bash", str(HERE / script)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before it was ready")
        try:
            # /health, not /v1/models: tokenmill lists its model while the engine core still loads it
            # (and answers requests 503 until then); /health is 200 only once all three can serve.
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")


def server_command(engine: str, port: int, model: PeerModel, vllm_bin: str, llama_server: str) -> list[str]:
    if engine in ("tokenmill", "tokenmill-int8"):
        int8 = ["--int8-activations"] if engine == "tokenmill-int8" else []
        return [sys.executable, "-m", "tokenmill.engine.cli.main", "serve", "--model", model.serve, "--port",
                str(port), "--max-num-seqs", "64", "--max-waiting-requests", "0", "--disable-access-log",
                "--served-model-name", "smollm2", *int8]  # fmt: skip
    if engine == "vllm":
        return [f"{vllm_bin}/vllm", "serve", model.hf_dir, "--port", str(port), "--served-model-name", "smollm2",
                "--dtype", "auto", "--max-num-seqs", "64"]
    from tokenmill.kernels.cpu_probe import read_cpu_flags

    if model.gguf is None:
        raise ValueError(f"llama.cpp serves GGUF files; model {model.name} has none")
    # On a CPU with AMX, ggml's AMX weight buffers crash this build at the first matmul (SIGSEGV in
    # ggml_backend_amx_mul_mat, 2-vCPU Xeon, 2026-12-02); --no-repack keeps weights in their GGUF
    # layout, which ran. Elsewhere llama.cpp keeps its default.
    no_repack = ["--no-repack"] if "amx_int8" in read_cpu_flags() else []
    return [llama_server, "-m", model.gguf, "--port", str(port), "-np", "64", "-c", "65536", "-kvu", "-cb", "-t",
            "2", "-tb", "2", "--jinja", "--alias", "smollm2", *no_repack]  # fmt: skip


def run_clients(
    engine: str, url: str, vllm_bin: str, wl: Workload, concurrency: int, num_prompts: int, out_dir: Path,
    model: PeerModel, clients: tuple[str, ...] = CLIENTS,
) -> list[PeerRow]:
    name = f"{engine}-{wl.prefix_len}-{concurrency}".replace(".", "")
    rows: list[PeerRow] = []
    if "vllm" in clients:
        rows += _run_vllm_client(engine, url, vllm_bin, wl, concurrency, num_prompts, out_dir, name, model)
    if wl.prefix_len == 0 and "tokenmill" in clients:  # our client's random dataset has no shared prefix
        n_in = f"random:{num_prompts}:{wl.input_len}:{wl.output_len}"
        subprocess.run([sys.executable, "-m", "tokenmill.engine.cli.main", "bench", "serve", "--base-url", url,
                        "--model", "smollm2", "--dataset", n_in, "--max-concurrency", str(concurrency),
                        "--no-progress", "--json", str(out_dir / f"{name}.tokenmill.json")],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        rows.append(row_from_result(engine, "tokenmill bench serve", wl.name, concurrency,
                                    json.loads((out_dir / f"{name}.tokenmill.json").read_text()), model.name))
    return rows


def _run_vllm_client(
    engine: str, url: str, vllm_bin: str, wl: Workload, concurrency: int, num_prompts: int, out_dir: Path, name: str,
    model: PeerModel,
) -> list[PeerRow]:
    subprocess.run([
        f"{vllm_bin}/vllm", "bench", "serve", "--backend", "openai", "--base-url", url, "--model", "smollm2",
        "--tokenizer", model.hf_dir, "--dataset-name", "random",
        "--random-input-len", str(wl.input_len), "--random-output-len", str(wl.output_len),
        "--random-prefix-len", str(wl.prefix_len), "--ignore-eos", "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--save-result", "--result-dir", str(out_dir),
        "--result-filename", f"{name}.vllm.json", "--disable-tqdm",
    ], check=True)  # fmt: skip
    return [row_from_result(engine, "vllm bench serve", wl.name, concurrency,
                            json.loads((out_dir / f"{name}.vllm.json").read_text()), model.name)]


def peak_rss_bytes(pid: int) -> int:
    """The largest VmHWM (peak resident memory) among process pid and its descendants (tokenmill's engine
    core is a child of its API server), 0 where /proc says nothing."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    peak, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
    return peak


def weights_read(engine: str, model: PeerModel, server_log: str) -> WeightsRead | None:
    """What `engine` holds for `model`: tokenmill's own count (its plan, the number `serve --check` prints
    and the operator sizes with), vLLM's parameters at the dtype its log names, llama.cpp's GGUF tensors as stored.
    None where the source says nothing (a vLLM log without its dtype)."""
    import re

    from tokenmill.engine import quant_memory

    if engine in ("tokenmill", "tokenmill-int8"):  # the plan on this machine: `serve --check`'s and the operator's count
        from tokenmill.engine.config import EngineConfig
        from tokenmill.engine.kv_memory import dtype_bytes
        from tokenmill.engine.worker.engine_plan import plan_engine

        plan = plan_engine(EngineConfig(model=model.serve, device="cpu"), config_only=True)
        held = plan.weights
        codes = sorted(t for t in held.types if t.startswith("Q") or t == "int4")
        # Codes are held where the weights take less than the served dtype's bytes (else dequantized at load);
        # without codes, less than those bytes is a bf16 checkpoint on the fp32 kernel's bf16 panels.
        below = held.loaded_bytes < held.parameters * dtype_bytes(plan.dtype)
        fmt = f"{'/'.join(codes)} codes ({plan.dtype})" if codes and below else plan.dtype
        if below and not codes:
            fmt = f"bf16 panels ({plan.dtype})"
        if engine == "tokenmill-int8" and "int8 activations" in server_log:  # the worker's log: the flag took
            fmt += ", int8 activations"
        return WeightsRead(engine, model.name, held.loaded_bytes, held.parameters, fmt)
    if engine == "vllm":
        m = re.search(r"dtype=torch\.(\w+)", server_log)
        if m is None:
            return None
        held = quant_memory.config_weights(json.loads((Path(model.hf_dir) / "config.json").read_text()),
                                           m.group(1), codes=False)  # fmt: skip
        return WeightsRead(engine, model.name, held.loaded_bytes, held.parameters, m.group(1))
    from tokenmill.engine.gguf_header import read_gguf_header

    assert model.gguf is not None
    held = quant_memory.gguf_weights(read_gguf_header(Path(model.gguf)).tensors, "bfloat16")
    return WeightsRead(engine, model.name, held.file_bytes, held.parameters, "GGUF " + "/".join(sorted(held.types)))


def run_peers(
    engines: list[str], concurrencies: list[int], num_prompts: int, out_dir: Path, models: list[PeerModel],
    port: int = 18700, ready_timeout_s: float = 900.0, workloads: tuple[str, ...] = tuple(WORKLOADS),
    clients: tuple[str, ...] = CLIENTS,
) -> tuple[list[PeerRow], list[WeightsRead]]:
    """Every model, every engine in turn: start, wait ready, every workload x concurrency, stop. Returns
    the rows and what each engine held of each model."""
    # vLLM's client runs against every engine: installed when it is asked for as a client or an engine.
    vllm_bin = install("install_vllm.sh") if "vllm" in engines or "vllm" in clients else ""
    llama_server = install("install_llama_cpp.sh") if "llama.cpp" in engines else ""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2", VLLM_HOST_IP="127.0.0.1",
               VLLM_CPU_OMP_THREADS_BIND="0-1", HF_HUB_OFFLINE="1")  # fmt: skip
    rows: list[PeerRow] = []
    weights: list[WeightsRead] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for model in models:
        model_out = out_dir / model.name if len(models) > 1 else out_dir
        model_out.mkdir(parents=True, exist_ok=True)
        for engine in engines:
            if engine == "llama.cpp" and model.gguf is None:
                print(f"llama.cpp: skipped for {model.name} (no GGUF of it)", file=sys.stderr)
                continue
            cmd = server_command(engine, port, model, vllm_bin, llama_server)
            log_path = model_out / f"{engine}.server.log"
            log = open(log_path, "w")
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=model_out)
            try:
                ready_s = _wait_ready(f"http://127.0.0.1:{port}", proc, ready_timeout_s)
                print(f"{model.name} {engine}: ready in {ready_s:.0f}s", file=sys.stderr)
                for wl in (WORKLOADS[w] for w in workloads):
                    for c in concurrencies:
                        rows += run_clients(engine, f"http://127.0.0.1:{port}", vllm_bin, wl, c,
                                            max(num_prompts, 2 * c), model_out, model, clients)  # fmt: skip
                        # Written after every run, so an interrupted table keeps what finished.
                        (out_dir / "rows.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
            finally:
                peak = peak_rss_bytes(proc.pid)
                print(f"{model.name} {engine}: peak RSS {peak / 1e6:.0f} MB (largest process of the server)",
                      file=sys.stderr)  # fmt: skip
                (model_out / f"{engine}.peak_rss.json").write_text(json.dumps({"peak_rss_bytes": peak}))
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                log.close()
            w = weights_read(engine, model, log_path.read_text(errors="replace"))
            if w is not None:
                weights.append(w)
    (out_dir / "rows.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    (out_dir / "weights.json").write_text(json.dumps([asdict(w) for w in weights], indent=2))
    return rows, weights
