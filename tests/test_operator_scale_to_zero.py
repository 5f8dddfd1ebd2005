"""Scale to zero and back (scaling.minReplicas 0 with routing): the pure decision (plan/scale_to_zero.py)
and whole reconciles against the fake API with stand-ins for the engines' and the router's /metrics. The
real endpoint picker holds real requests for real engines in e2e/test_routing.py."""

import pytest
from test_operator_reconcile import NS, FakeApi, add_isvc, cond, deployment_ready, make_pods, run, smol
from test_operator_router_reconcile import POOL_API, ServedApi, router_ready
from tokenmill.operator.plan.observations import PodReading
from tokenmill.operator.plan.scale_to_zero import Readings, ZeroState, decide_zero, predicted_wake

QUIET = Readings(engines_busy=False, prompt_tokens=100.0, router_queue=0.0, ready=1)


def test_idle_counts_from_the_last_request_and_scales_to_zero_after_idle_seconds():
    s = ZeroState(last_active=1000.0, prompt_tokens=100.0)
    assert decide_zero(60, 1, QUIET, s, True, 1059).replicas is None
    d = decide_zero(60, 1, QUIET, s, True, 1060)
    assert d.replicas == 0 and (d.condition.status, d.condition.reason) == ("True", "Idle")
    assert "no request for 60s (idleSeconds 60)" in d.why


@pytest.mark.parametrize("reading", [
    Readings(engines_busy=True, prompt_tokens=100.0, router_queue=0.0, ready=1),  # a request in an engine
    Readings(engines_busy=False, prompt_tokens=180.0, router_queue=0.0, ready=1),  # one came and went
    Readings(engines_busy=False, prompt_tokens=100.0, router_queue=2.0, ready=1),  # held by the router
])
def test_any_request_restarts_the_idle_clock(reading):
    d = decide_zero(60, 1, reading, ZeroState(last_active=1000.0, prompt_tokens=100.0), True, 5000)
    assert d.replicas is None and d.state.last_active == 5000
    assert (d.condition.status, d.condition.reason) == ("False", "Serving")


@pytest.mark.parametrize("reading, fresh", [
    (Readings(engines_busy=None, prompt_tokens=None, router_queue=0.0, ready=1), True),  # a pod unread
    (Readings(engines_busy=False, prompt_tokens=100.0, router_queue=None, ready=1), True),  # router unread
    (QUIET, False),  # the autoscaler had no fresh metrics this pass
])
def test_what_was_not_read_never_counts_as_idle(reading, fresh):
    d = decide_zero(60, 1, reading, ZeroState(last_active=1000.0, prompt_tokens=100.0), fresh, 5000)
    assert d.replicas is None


def test_a_held_request_wakes_the_service_and_the_wake_is_measured():
    at_zero = ZeroState(last_active=1000.0, prompt_tokens=100.0)
    d = decide_zero(60, 0, Readings(None, None, router_queue=0.0), at_zero, False, 2000)
    assert d.replicas == 0 and d.condition.reason == "Idle"
    d = decide_zero(60, 0, Readings(None, None, router_queue=1.0), at_zero, False, 2001)
    assert d.replicas == 1 and d.condition.reason == "Waking" and d.state.wake_requested == 2001
    loading = decide_zero(60, 1, Readings(False, None, router_queue=1.0, ready=0), d.state, False, 2010)
    assert loading.replicas is None and loading.state.wake_requested == 2001 and loading.wake_seconds is None
    ready = decide_zero(60, 1, Readings(True, 0.0, router_queue=0.0, ready=1, first_ready_at=2013.0),
                        loading.state, True, 2015)
    assert ready.wake_seconds == 12.0 and ready.state.last_wake_seconds == 12.0
    assert ready.state.wake_requested is None and ready.state.last_active == 2015
    # a wake still waiting for its replica never goes back to zero, however long it takes
    slow = decide_zero(60, 1, Readings(False, None, router_queue=0.0, ready=0), loading.state, True, 9000)
    assert slow.replicas is None and slow.state.wake_requested == 2001


def test_predicted_wake_prefers_what_was_measured():
    assert predicted_wake(12.34, 30.0, 8.0, 601) == (12.3, "lastWake")
    assert predicted_wake(None, 30.04, 8.0, 601) == (30.0, "podStart")  # the whole start, not only the load
    assert predicted_wake(None, None, 8.04, 601) == (8.0, "modelLoadSeconds")
    assert predicted_wake(None, None, None, 601) == (601.0, "startupBudget")


# ---------------------------------------------------------------- whole reconciles


def engines(depth: float, tokens: float):
    def scrape(pods, timeout):
        return {p["metadata"]["name"]: PodReading(running=depth, prompt_tokens=tokens,
                                                  capacity={"modelLoadSeconds": 9.5}) for p in pods}
    return scrape


def router(held: float | None):
    return lambda pool, pods, timeout: (held, None if held is not None else "unreadable")


def routed_to_zero(api: FakeApi, idle: int = 30) -> None:
    add_isvc(api, smol(routing={"enabled": True},
                       scaling={"minReplicas": 0, "maxReplicas": 2, "idleSeconds": idle, "targetQueueDepth": 4}))


def test_a_routed_service_starts_at_one_idles_to_zero_and_wakes_on_a_held_request():
    api = ServedApi(POOL_API)
    routed_to_zero(api)
    run(api, now=1000)
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1  # its first load is measured
    deployment_ready(api)
    router_ready(api)
    make_pods(api, 1)
    status = run(api, autoscale=True, now=1001, scrape=engines(1, 50), read_held=router(0))
    assert cond(status, "ScaledToZero")["reason"] == "Serving"
    run(api, autoscale=True, now=1020, scrape=engines(0, 80), read_held=router(0))  # tokens moved: a request
    run(api, autoscale=True, now=1049, scrape=engines(0, 80), read_held=router(0))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1  # 29 s quiet of 30
    status = run(api, autoscale=True, now=1050, scrape=engines(0, 80), read_held=router(0))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 0
    assert (cond(status, "ScaledToZero")["status"], cond(status, "ScaledToZero")["reason"]) == ("True", "Idle")
    assert any(e[1] == "ScaledDown" and "no request for 30s" in e[2] for e in api.events)
    assert status["scaling"]["wake"]["predictedFrom"] == "modelLoadSeconds"  # no pod creation time to go by
    assert status["scaling"]["wake"]["predictedSeconds"] == 9.5

    api.pods = []
    api.objects[("Deployment", NS, "chat")]["status"] = {"replicas": 0, "readyReplicas": 0}
    status = run(api, autoscale=True, now=1100, scrape=engines(0, 0), read_held=router(0))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 0
    # at zero the service is available: its router holds requests and wakes it
    assert (cond(status, "Ready")["status"], cond(status, "Ready")["reason"]) == ("True", "ScaledToZero")
    status = run(api, autoscale=True, now=1101, scrape=engines(0, 0), read_held=router(1))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1
    assert cond(status, "ScalingActive")["reason"] == "WakingFromZero"
    assert status["scaling"]["wake"]["requestedTime"] == "1970-01-01T00:18:21Z"
    assert any(e[1] == "ScaledUp" and "the router holds 1 request" in e[2] for e in api.events)
    make_pods(api, 1)
    api.pods[0]["status"]["conditions"][0]["lastTransitionTime"] = "1970-01-01T00:18:35Z"  # 1115
    deployment_ready(api)
    status = run(api, autoscale=True, now=1117, scrape=engines(1, 30), read_held=router(0))
    assert status["scaling"]["wake"]["lastSeconds"] == 14.0 and status["scaling"]["wake"]["predictedFrom"] == "lastWake"
    assert "requestedTime" not in status["scaling"]["wake"]  # the wake is over
    assert sum(e[1] == "Woke" and "14.0s" in e[2] for e in api.events) == 1
    # idle again: back to 0 after idleSeconds from the wake, with the measured wake kept and no second Woke
    run(api, autoscale=True, now=1140, scrape=engines(0, 30), read_held=router(0))
    status = run(api, autoscale=True, now=1148, scrape=engines(0, 30), read_held=router(0))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 0
    assert status["scaling"]["wake"]["lastSeconds"] == 14.0
    assert sum(e[1] == "Woke" for e in api.events) == 1


def test_no_scale_to_zero_while_the_router_cannot_be_read():
    api = ServedApi(POOL_API)
    routed_to_zero(api, idle=10)
    run(api, now=1000)
    deployment_ready(api)
    router_ready(api)
    make_pods(api, 1)
    for t in (1001, 1100, 1200):
        run(api, autoscale=True, now=t, scrape=engines(0, 50), read_held=router(None))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1


def test_the_router_queue_is_demand_for_the_autoscaler():
    api = ServedApi(POOL_API)
    add_isvc(api, smol(routing={"enabled": True}, scaling={"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 4}))
    run(api, now=1000)
    deployment_ready(api)
    make_pods(api, 1)
    # the engine holds 4 (its target), the router holds 5 more that no pod could take: ceil(9 / 4) = 3
    status = run(api, autoscale=True, now=1001, scrape=engines(4, 10), read_held=router(5))
    assert api.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 3
    assert status["scaling"]["routerQueueDepth"] == 5 and status["scaling"]["currentQueueDepth"] == 9
    assert "+5 held by the router" in cond(status, "ScalingActive")["message"]


def test_a_replicas_start_measured_from_its_pod_predicts_the_first_wake():
    api = ServedApi(POOL_API)
    routed_to_zero(api)
    run(api, now=1000)
    deployment_ready(api)
    router_ready(api)
    make_pods(api, 1)
    pod = api.pods[0]
    pod["metadata"]["creationTimestamp"] = "1970-01-01T00:16:40Z"  # 1000
    pod["status"]["conditions"][0]["lastTransitionTime"] = "1970-01-01T00:17:17Z"  # 1037: 37 s to start
    status = run(api, autoscale=True, now=1040, scrape=engines(0, 50), read_held=router(0))
    wake = status["scaling"]["wake"]
    assert (wake["podStartSeconds"], wake["predictedSeconds"], wake["predictedFrom"]) == (37.0, 37.0, "podStart")
