"""vLLM's serving-benchmark definitions, checked on synthetic timings computed by hand."""

import math

import numpy as np
import pytest
from tokenmill.engine.bench.serve_stats import (
    RequestFuncOutput,
    arrival_times,
    calculate_metrics,
    parse_slo,
    tpot,
)


def _outputs():
    # A: chunks at 0.1, 0.3, 0.6 s. B: chunks at 0.2, 0.3 s. C: one chunk at 0.5 s. D: failed.
    a = RequestFuncOutput(True, 10, 3, ttft=0.1, itl=[0.2, 0.3], latency=0.6)
    b = RequestFuncOutput(True, 20, 2, ttft=0.2, itl=[0.1], latency=0.3)
    c = RequestFuncOutput(True, 30, 1, ttft=0.5, itl=[], latency=0.5)
    d = RequestFuncOutput(False, 40, 0, error="HTTP 500: boom")
    return [a, b, c, d]


def test_tpot_excludes_the_first_token():
    a, b, c, _ = _outputs()
    assert tpot(a) == pytest.approx(0.25)  # (0.6 - 0.1) / (3 - 1)
    assert tpot(b) == pytest.approx(0.1)
    assert tpot(c) is None


def test_metrics_match_hand_computed_values():
    m = calculate_metrics(_outputs(), duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(33.0)
    # TTFT 100, 200, 500 ms: linear-interpolated p90 at rank 1.8 = 200 + 0.8 * 300
    assert m["ttft"]["mean_ms"] == pytest.approx(800 / 3)
    assert m["ttft"]["median_ms"] == pytest.approx(200)
    assert m["ttft"]["p90_ms"] == pytest.approx(440)
    assert m["ttft"]["p99_ms"] == pytest.approx(494)
    # TPOT only for outputs longer than one token: 250, 100 ms
    assert m["tpot"]["mean_ms"] == pytest.approx(175)
    assert m["tpot"]["p90_ms"] == pytest.approx(235)
    # ITL pools every gap: 200, 300, 100 ms
    assert m["itl"]["mean_ms"] == pytest.approx(200)
    assert m["itl"]["median_ms"] == pytest.approx(200)
    assert m["e2el"]["mean_ms"] == pytest.approx(1400 / 3)
    assert m["e2el"]["median_ms"] == pytest.approx(500)
    assert m["errors"] == ["HTTP 500: boom"]
    assert "goodput" not in m


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        ("ttft:300,tpot:200", 1),  # A fails TPOT 250, C fails TTFT 500
        ("ttft:600", 3),
        ("e2el:400", 1),  # only B (300 ms)
        ("tpot:100", 2),  # B at exactly 100 passes; C's single token counts as TPOT 0
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slo, good):
    m = calculate_metrics(_outputs(), duration_s=2.0, slo=parse_slo(slo))
    assert m["good_requests"] == good
    assert m["goodput"] == pytest.approx(good / 2.0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("ttft", "NAME:MS"), ("latency:5", "NAME:MS"), ("ttft:abc", "not a number"), ("tpot:0", "> 0"), ("", "at least")],
)
def test_bad_slo_is_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_slo(spec)


def test_no_successes_gives_nan_not_a_crash():
    m = calculate_metrics([RequestFuncOutput(False, error="x")], duration_s=1.0)
    assert m["completed"] == 0 and math.isnan(m["ttft"]["mean_ms"])


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.5])
def test_gamma_arrivals_have_the_requested_rate_and_shape(burstiness):
    rate = 4.0
    t = arrival_times(40001, rate, burstiness, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    # gamma(k, 1/(rate k)): mean 1/rate, squared coefficient of variation 1/k
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.06)


def test_poisson_gaps_are_exponential():
    gaps = np.diff(arrival_times(40001, 2.0, 1.0, seed=2))
    # For an exponential, P(gap > mean) = 1/e and P(gap > 2 mean) = 1/e^2.
    assert np.mean(gaps > 0.5) == pytest.approx(math.exp(-1), abs=0.01)
    assert np.mean(gaps > 1.0) == pytest.approx(math.exp(-2), abs=0.01)


def test_arrivals_are_seeded_and_validated():
    assert arrival_times(10, 3.0, 1.0, seed=5) == arrival_times(10, 3.0, 1.0, seed=5)
    assert arrival_times(10, 3.0, 1.0, seed=5) != arrival_times(10, 3.0, 1.0, seed=6)
    with pytest.raises(ValueError, match="request rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0.0)
