from tokenmill.operator.plan.autoscaler import (
    Recommendation,
    decide,
    decide_with_total,
    raw_recommendation,
    stabilize,
)
from tokenmill.operator.plan.spec import ScalingSpec


def scaling(lo=1, hi=8, up=0, down=300) -> ScalingSpec:
    return ScalingSpec(lo, hi, None, up, down, "pods")


def pods(n: int) -> list[str]:
    return [f"p{i}" for i in range(n)]


def test_raw_recommendation_is_queue_over_target():
    # 2 pods reporting 37 + 20 = 57 requests, target 10 -> ceil(5.7) = 6
    assert raw_recommendation({"p0": 37, "p1": 20}, pods(2), 2, 10, scaling()) == 6
    assert raw_recommendation({"p0": 0, "p1": 0}, pods(2), 2, 10, scaling()) == 1  # min
    assert raw_recommendation({"p0": 500}, pods(1), 1, 10, scaling(hi=8)) == 8  # max


def test_missing_pods_count_idle_for_scale_up_and_at_target_for_scale_down():
    # 3 ready, one silent. Up: 45 / 10 -> 5 > 3, the silent pod counted as 0
    assert raw_recommendation({"p0": 25, "p1": 20}, pods(3), 3, 10, scaling()) == 5
    # Down: 4 + 2 = 6 would say 1, but the silent pod counts at target: ceil(16 / 10) = 2, not 1
    assert raw_recommendation({"p0": 4, "p1": 2}, pods(3), 3, 10, scaling()) == 2
    # a silent pod never causes a scale on its own: 2 reporting at target hold 3
    assert raw_recommendation({"p0": 10, "p1": 10}, pods(3), 3, 10, scaling()) == 3


def test_scale_up_is_immediate_with_a_zero_window():
    d = decide(scaling(), 2, pods(2), {"p0": (40, None), "p1": (40, None)}, 10, (), now=1000)
    assert d.active and d.reason == "MetricsAvailable" and d.replicas == 8
    assert "queue depth 80" in d.message and "target 10" in d.message


def test_scale_up_window_takes_the_lowest_recent_recommendation():
    s = scaling(up=60)
    history = (Recommendation(900, 2),)  # 100 s ago, outside the window: it held until now
    d = decide(s, 2, pods(2), {"p0": (30, None), "p1": (30, None)}, 10, history, now=1000)
    assert d.replicas == 2  # the value in force at the window start (2) bounds the scale-up
    d2 = decide(s, 2, pods(2), {"p0": (30, None), "p1": (30, None)}, 10, d.history, now=1061)
    assert d2.replicas == 6  # a full minute of 6: go


def test_scale_down_waits_for_the_whole_window():
    s = scaling(down=300)
    h = (Recommendation(0, 4),)
    d = decide(s, 4, pods(4), {p: (1, None) for p in pods(4)}, 10, h, now=100)
    assert d.replicas == 4  # recommend 1, but 4 was in force 300 s ago
    d = decide(s, 4, pods(4), {p: (1, None) for p in pods(4)}, 10, d.history, now=399)
    assert d.replicas == 4  # 4 still in force at 99 (until the change point at 100)
    d = decide(s, 4, pods(4), {p: (1, None) for p in pods(4)}, 10, d.history, now=401)
    assert d.replicas == 1


def test_no_flapping_on_a_spike_inside_the_down_window():
    s = scaling(down=300)
    d = decide(s, 2, pods(2), {"p0": (5, None), "p1": (5, None)}, 10, (Recommendation(0, 2),), now=1000)
    assert d.replicas == 2
    d = decide(s, 2, pods(2), {"p0": (30, None), "p1": (30, None)}, 10, d.history, now=1015)  # spike: 6
    assert d.replicas == 6
    d = decide(s, 6, pods(6), {p: (1, None) for p in pods(6)}, 10, d.history, now=1030)  # gone again
    assert d.replicas == 6  # held: 6 was recommended 15 s ago
    # 6 stayed the recommendation until 1030: the window must be clear of it, so 1330
    held = decide(s, 6, pods(6), {p: (1, None) for p in pods(6)}, 10, d.history, now=1329)
    assert held.replicas == 6
    d = decide(s, 6, pods(6), {p: (1, None) for p in pods(6)}, 10, held.history, now=1331)
    assert d.replicas == 1


def test_hold_when_all_metrics_are_missing():
    h = (Recommendation(0, 3),)
    d = decide(scaling(), 3, pods(3), {}, 10, h, now=100)
    assert not d.active and d.reason == "MetricsMissing" and d.replicas == 3
    assert "holding at 3 replicas" in d.message
    assert d.history == h  # a hold records nothing


def test_hold_when_metrics_are_stale():
    d = decide(scaling(), 3, pods(3), {p: (50, 0.0) for p in pods(3)}, 10, (), now=500, stale_after=120)
    assert not d.active and d.reason == "MetricsStale" and d.replicas == 3
    fresh = decide(scaling(), 3, pods(3), {p: (50, 450.0) for p in pods(3)}, 10, (), now=500, stale_after=120)
    assert fresh.active and fresh.replicas == 8


def test_hold_with_no_ready_pods_but_respect_min():
    d = decide(scaling(lo=2), 1, [], {}, 10, (), now=0)
    assert not d.active and d.reason == "NoReadyPods" and d.replicas == 2


def test_partial_staleness_reports_the_silent_pods():
    d = decide(scaling(), 2, pods(2), {"p0": (25, 990.0), "p1": (25, 100.0)}, 10, (), now=1000, stale_after=120)
    assert d.active and d.replicas == 3  # only p0's 25 is fresh: ceil(25 / 10)
    assert "p1" in d.message


def test_history_is_pruned_to_the_longest_window():
    points = tuple(Recommendation(t, t % 5 + 1) for t in range(0, 1000, 10))
    _replicas, kept = stabilize(points, 3, 3, now=1000, up_window=0, down_window=300)
    assert kept[0].time <= 700 < kept[1].time  # one point before the window start, the rest inside
    assert all(p.time > 700 for p in kept[1:])


def test_custom_total_query():
    d = decide_with_total(scaling(), 2, 45.0, 10, (), now=0)
    assert d.replicas == 5 and d.active
