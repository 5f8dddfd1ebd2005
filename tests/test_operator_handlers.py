"""The Kopf wiring, without a cluster: what is registered, what Kopf may write, and the handler logic
against a fake API. The operator against a real API server is the e2e suite's job."""

import asyncio
import types

import kopf
import pytest
from tokenmill.operator import handlers
from tokenmill.operator import reconcile as rec


def test_kopf_writes_nothing_to_our_objects():
    registry = kopf.get_default_registry()
    # no on.create/update/resume handlers: no progress or last-handled-configuration annotations
    assert registry._changing.get_all_handlers() == []
    spawning = registry._spawning.get_all_handlers()
    assert len(spawning) == 1 and all(h.requires_finalizer is False for h in spawning)
    watched = {(h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers()}
    assert watched == {("serving.tokenmill.dev", "inferenceservices"), ("apps", "deployments")}


def test_deployment_watch_is_filtered_to_ours():
    (h,) = [h for h in kopf.get_default_registry()._watching.get_all_handlers() if h.selector.group == "apps"]
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


class Stopped:
    """Stands in for kopf.DaemonStopped: false until `stop_after` waits."""

    def __init__(self, stop_after=100):
        self.waits, self.stop_after = 0, stop_after

    def __bool__(self):
        return self.waits > self.stop_after

    async def wait(self, timeout=None):
        self.waits += 1
        await asyncio.sleep(0)


def test_daemon_exits_when_the_object_is_gone(monkeypatch):
    calls = []
    monkeypatch.setattr(rec, "reconcile", lambda api, body, config, autoscale: calls.append(autoscale))
    api = Api(None)
    asyncio.run(handlers.keep_serving(stopped=Stopped(), name="chat", namespace="ns", uid="u1", memo=memo_with(api)))
    assert api.gets == 1 and calls == []


def test_daemon_autoscales_each_tick_until_stopped(monkeypatch):
    calls = []
    monkeypatch.setattr(rec, "reconcile", lambda api, body, config, autoscale: calls.append(autoscale))
    api = Api({"metadata": {"name": "chat", "namespace": "ns", "uid": "u1"}})
    asyncio.run(handlers.keep_serving(stopped=Stopped(stop_after=3), name="chat", namespace="ns", uid="u1",
                                      memo=memo_with(api)))
    assert calls == [True, True, True]
    # a new object with the same name has its own loop: this one stops
    api = Api({"metadata": {"name": "chat", "namespace": "ns", "uid": "other"}})
    asyncio.run(handlers.keep_serving(stopped=Stopped(), name="chat", namespace="ns", uid="u1", memo=memo_with(api)))
    assert len(calls) == 3


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
