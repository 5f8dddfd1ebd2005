"""vLLM's serving-benchmark definitions: arrivals, TTFT, TPOT, ITL, E2EL, goodput.

Kept free of I/O so the definitions can be checked against hand-computed timings.
"""

from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestFuncOutput:
    """One request's timings, in seconds; itl holds every gap between streamed chunks."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL: request sent to last chunk received
    start_time: float = 0.0
    error: str = ""


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s) of each request. Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)),
    so the mean rate is `request_rate` and burstiness 1 is Poisson; rate inf sends all at once.

    As in vLLM, the first request goes out at 0 and each later one one gap after the previous.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num <= 0:
        return []
    if np.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_slo(spec: str) -> dict[str, float]:
    """`ttft:500,tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo item {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo item {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--slo item {item!r}: the limit must be > 0 ms")
        slo[name] = ms
    if not slo:
        raise ValueError(f"--slo {spec!r}: give at least one of {', '.join(SLO_METRICS)} as NAME:MS")
    return slo


def tpot(out: RequestFuncOutput) -> float | None:
    """Time per output token after the first; undefined for single-token outputs."""
    if out.output_tokens <= 1:
        return None
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def meets_slo(out: RequestFuncOutput, slo: dict[str, float]) -> bool:
    # vLLM counts a single-token output's TPOT as 0 for goodput.
    values_ms = {"ttft": out.ttft * 1000, "tpot": (tpot(out) or 0.0) * 1000, "e2el": out.latency * 1000}
    return all(values_ms[name] <= limit for name, limit in slo.items())


def summarize(values_s: list[float]) -> dict[str, float]:
    """mean/median/p90/p99 (and std) in milliseconds; NaN when there are no values."""
    if not values_s:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "std_ms": float("nan"),
                **{f"p{p}_ms": float("nan") for p in PERCENTILES if p != 50}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    out = {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "std_ms": float(ms.std())}
    out.update({f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES if p != 50})
    return out


def calculate_metrics(
    outputs: list[RequestFuncOutput], duration_s: float, slo: dict[str, float] | None = None
) -> dict[str, object]:
    ok = [o for o in outputs if o.success]
    total_out = sum(o.output_tokens for o in ok)
    total_in = sum(o.prompt_len for o in ok)
    metrics: dict[str, object] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft": summarize([o.ttft for o in ok]),
        "tpot": summarize([t for o in ok if (t := tpot(o)) is not None]),
        "itl": summarize([gap for o in ok for gap in o.itl]),
        "e2el": summarize([o.latency for o in ok]),
    }
    if slo:
        good = sum(meets_slo(o, slo) for o in ok)
        metrics["slo"] = slo
        metrics["good_requests"] = good
        metrics["goodput"] = good / duration_s
    errors = sorted({o.error for o in outputs if not o.success})
    if errors:
        metrics["errors"] = errors[:5]
    return metrics
