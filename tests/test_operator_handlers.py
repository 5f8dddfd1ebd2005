"""The Kopf wiring, without a cluster: what is registered, what Kopf may write, and the handler logic
against a fake API. The operator against a real API server is the e2e suite's job."""

import asyncio
import datetime
import pathlib
import types

import kopf
import pytest
from tokenmill.operator import handlers
from tokenmill.operator import reconcile as rec
from tokenmill.operator.leadership import acting


def test_kopf_writes_nothing_to_our_objects():
    registry = kopf.get_default_registry()
    # no on.create/update/resume handlers: no progress or last-handled-configuration annotations
    assert registry._changing.get_all_handlers() == []
    # no daemons or timers: Kopf would put a finalizer on every InferenceService for them
    assert registry._spawning.get_all_handlers() == []
    watched = {(h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers()}
    assert watched == {("serving.tokenmill.dev", "inferenceservices"), ("apps", "deployments"),
                       ("leaderworkerset.x-k8s.io", "leaderworkersets")}


def test_deployment_watch_is_filtered_to_ours():
    for group in ("apps", "leaderworkerset.x-k8s.io"):
        (h,) = [h for h in kopf.get_default_registry()._watching.get_all_handlers() if h.selector.group == group]
        assert h.labels == {"app.kubernetes.io/managed-by": "tokenmill-operator"}


@pytest.mark.parametrize(("event", "gen", "observed", "wanted"), [
    (None, 1, None, True), ("ADDED", 1, 1, True), ("MODIFIED", 2, 1, True), ("MODIFIED", 2, 2, False),
])
def test_reconcile_on_new_objects_and_new_generations(event, gen, observed, wanted):
    body = {"metadata": {"generation": gen}, "status": {"observedGeneration": observed} if observed else {}}
    assert handlers._needs_reconcile(event, body) is wanted


class Api:
    def __init__(self, obj=None, installed=True):
        self.obj, self.installed, self.gets = obj, installed, 0

    def get(self, kind, ns, name):
        self.gets += 1
        return self.obj

    def has_resource(self, group, version, plural):
        return self.installed


def memo_with(api):
    return types.SimpleNamespace(api=api, config=rec.OperatorConfig(interval=0.01))


def test_deployment_event_reconciles_the_owner(monkeypatch):
    calls = []
    monkeypatch.setattr(rec, "reconcile", lambda api, body, config, autoscale: calls.append((body, autoscale)))
    owner = {"metadata": {"name": "chat", "namespace": "ns", "uid": "u1"}}
    dep = {"metadata": {"name": "chat", "namespace": "ns",
                        "ownerReferences": [{"kind": "InferenceService", "name": "chat", "uid": "u1"}]}}
    handlers.on_deployment_event(event={"type": "MODIFIED"}, body=dep, memo=memo_with(Api(owner)))
    assert calls == [(owner, False)]
    # an owner recreated under the same name (other uid) is not this Deployment's owner
    handlers.on_deployment_event(event={"type": "MODIFIED"}, body=dep,
                                 memo=memo_with(Api({"metadata": {"name": "chat", "uid": "u2"}})))
    assert len(calls) == 1


def test_a_failing_reconcile_does_not_escape(monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("API server hiccup")

    monkeypatch.setattr(rec, "reconcile", boom)
    body = {"metadata": {"name": "chat", "namespace": "ns", "generation": 1}}
    handlers.on_service_event(event={"type": "ADDED"}, body=body, memo=memo_with(Api()))
    assert "reconcile of InferenceService ns/chat failed" in caplog.text


def test_handlers_use_only_kopfs_public_api():
    """Review finding (issue 14): the handlers rewrote Kopf's private registry._spawning._handlers."""
    source = pathlib.Path(handlers.__file__).read_text()
    assert "._" not in source.replace("._safe", "").replace("__", ""), "a private Kopf attribute is used"


def loop_memo(api, peering=None):
    memo = memo_with(api)
    memo.loops, memo.peering = {}, peering
    return memo


class Api2(Api):
    """Answers `obj` for the first `live` reads of the InferenceService, then None (deleted)."""

    def __init__(self, obj, live=3, peering=None):
        super().__init__(obj)
        self.live, self.peering, self.peering_reads = live, peering, 0

    def get(self, kind, ns, name):
        if kind.endswith("KopfPeering"):
            self.peering_reads += 1
            return self.peering
        self.gets += 1
        return self.obj if self.gets <= self.live else None


def test_the_loop_autoscales_each_tick_until_the_object_is_gone(monkeypatch):
    calls = []
    monkeypatch.setattr(rec, "reconcile", lambda api, body, config, autoscale: calls.append(autoscale))
    api = Api2({"metadata": {"name": "chat", "namespace": "ns", "uid": "u1"}}, live=3)
    asyncio.run(asyncio.wait_for(handlers.keep_serving(loop_memo(api), "ns", "chat", "u1"), 10))
    assert calls == [True, True, True] and api.gets == 4
    # a new object with the same name has its own loop: this one stops
    api = Api2({"metadata": {"name": "chat", "namespace": "ns", "uid": "other"}})
    asyncio.run(asyncio.wait_for(handlers.keep_serving(loop_memo(api), "ns", "chat", "u1"), 10))
    assert len(calls) == 3


def peer(priority, age_s=1, lifetime=60):
    seen = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=age_s)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


def test_leadership_follows_kopfs_rule():
    assert acting({"me": peer(5), "other": peer(3)}, 5)
    assert not acting({"me": peer(5), "other": peer(9)}, 5)
    assert acting({"me": peer(5), "other": peer(9, age_s=120)}, 5)  # a dead peer does not count
    assert not acting({"me": peer(5), "twin": peer(5)}, 5)  # Kopf pauses every replica then
    assert acting(None, 5) and acting({"me": peer(5), "junk": {"priority": 9}}, 5)


def test_a_standby_loop_reconciles_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(rec, "reconcile", lambda api, body, config, autoscale: calls.append(autoscale))
    obj = {"metadata": {"name": "chat", "namespace": "ns", "uid": "u1"}}
    api = Api2(obj, peering={"status": {"me": peer(5), "active": peer(9)}})

    async def a_few_ticks():
        task = asyncio.create_task(handlers.keep_serving(loop_memo(api, ("p", 5, True)), "ns", "chat", "u1"))
        while api.peering_reads < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(a_few_ticks(), 10))
    assert calls == [] and api.gets == 0
    api = Api2(obj, live=1, peering={"status": {"me": peer(5), "standby": peer(2)}})
    asyncio.run(asyncio.wait_for(handlers.keep_serving(loop_memo(api, ("p", 5, True)), "ns", "chat", "u1"), 10))
    assert calls == [True]


def test_events_start_one_loop_per_object_and_deletion_stops_it():
    api = Api2({"metadata": {"name": "chat", "namespace": "ns", "uid": "u1"}}, live=10**6)
    memo = loop_memo(api)
    memo.config = rec.OperatorConfig(interval=3600)

    async def events():
        for type_ in (None, "MODIFIED", "MODIFIED"):
            await handlers.track_loops(event={"type": type_}, name="chat", namespace="ns", uid="u1", memo=memo)
        assert len(memo.loops) == 1
        (_uid, task) = memo.loops[("ns", "chat")]
        await handlers.track_loops(event={"type": "DELETED"}, name="chat", namespace="ns", uid="u1", memo=memo)
        await asyncio.sleep(0)
        assert memo.loops == {} and task.cancelled()

    asyncio.run(asyncio.wait_for(events(), 10))


def test_startup_refuses_to_run_without_the_crd():
    settings = kopf.OperatorSettings()
    with pytest.raises(kopf.PermanentError, match="kubectl apply -f crds/"):
        handlers.configure(settings=settings, memo=memo_with(Api(installed=False)))
    handlers.configure(settings=settings, memo=memo_with(Api(installed=True)))
    assert settings.scanning.disabled is True and settings.posting.enabled is False


def test_login_uses_kubeconfig_when_set(monkeypatch, tmp_path):
    kc = tmp_path / "kubeconfig"
    kc.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443', "
                  "certificate-authority-data: Q0E=}}]\nusers: [{name: sa, user: {token: sa-token}}]\n"
                  "contexts: [{name: x, context: {cluster: c, user: sa, namespace: team-a}}]\ncurrent-context: x\n")
    monkeypatch.setenv("KUBECONFIG", str(kc))
    info = handlers.login(settings=kopf.OperatorSettings(), logger=None)
    assert info.server == "https://127.0.0.1:6443" and info.token == "sa-token" and info.default_namespace == "team-a"
