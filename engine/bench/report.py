"""The comparison table and plot for `bench compare`."""

import textwrap
from typing import Any

import numpy as np
from tokenmill.engine.bench.baselines import SystemResult


def percentile(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")


def result_row(r: SystemResult, naive: SystemResult | None, total_requests: int) -> dict[str, Any]:
    return {
        "system": r.name,
        "requests": r.requests,
        "subset": r.requests < total_requests,
        "generated_tokens": r.generated_tokens,
        "seconds": r.seconds,
        "tokens_per_s": r.tokens_per_s,
        "ratio_to_naive": r.tokens_per_s / naive.tokens_per_s if naive else None,
        "cpu_seconds": r.cpu_seconds,
        "tokens_per_cpu_s": r.tokens_per_cpu_s,
        "ratio_to_naive_cpu": r.tokens_per_cpu_s / naive.tokens_per_cpu_s if naive else None,
        "median_completion_s": percentile(r.completion_times, 50),
        "p95_completion_s": percentile(r.completion_times, 95),
        "note": r.note,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'system':<34} {'reqs':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'x naive':>8} " \
           f"{'median s':>9} {'p95 s':>8} {'tok/cpu-s':>10} {'x naive(cpu)':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio_to_naive']:.2f}" if r["ratio_to_naive"] is not None else "-"
        ratio_cpu = f"{r['ratio_to_naive_cpu']:.2f}" if r["ratio_to_naive_cpu"] is not None else "-"
        lines.append(
            f"{r['system']:<34} {r['requests']:>5} {r['generated_tokens']:>7} {r['seconds']:>8.1f} "
            f"{r['tokens_per_s']:>8.1f} {ratio:>8} {r['median_completion_s']:>9.1f} {r['p95_completion_s']:>8.1f}"
            f" {r['tokens_per_cpu_s']:>10.1f} {ratio_cpu:>12}  {r['note']}"
        )
    return "\n".join(lines)


def plot(results: list[SystemResult], naive_tps: float | None, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_cdf) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [textwrap.fill(r.name, 20) + f"\n({r.requests} reqs)" for r in results]
    tps = [r.tokens_per_s for r in results]
    bars = ax_tps.bar(range(len(results)), tps, color=["#999999", "#bbbb55", "#5599cc", "#cc5533"][: len(results)])
    ax_tps.set_xticks(range(len(results)), names, fontsize=7)
    ax_tps.set_ylabel("useful generated tokens / s")
    ax_tps.set_title("throughput")
    for bar, value in zip(bars, tps, strict=True):
        label = f"{value:.0f}" + (f"\n{value / naive_tps:.1f}x" if naive_tps else "")
        ax_tps.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
    for r in results:
        if r.completion_times:
            t = np.sort(r.completion_times)
            ax_cdf.step(t, np.arange(1, len(t) + 1) / len(t), where="post", label=f"{r.name} ({r.requests})")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("request completion time (s, all requests arrive at 0)")
    ax_cdf.set_ylabel("fraction of requests done")
    ax_cdf.set_title("completion-time distribution")
    ax_cdf.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
