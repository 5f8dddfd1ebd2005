"""The Argo CD health Lua, run by two real Lua 5.1 interpreters: lupa (PUC Lua 5.1) and gopher-lua v1.1.2,
the Go Lua VM Argo CD embeds (e2e/tools/luahealth, driven the way Argo CD drives it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from gitops_tools import lua_health
from lupa import lua51

ARGOCD = Path(__file__).resolve().parent.parent / "charts" / "argocd"
LUA_FILE = ARGOCD / "inferenceservice-health.lua"
LUA = LUA_FILE.read_text()
HEALTH_KEY = "resource.customizations.health.serving.tokenmill.dev_InferenceService"


def to_lua(lua: lua51.LuaRuntime, value):
    """JSON-shaped Python -> Lua tables, the way Argo CD hands `obj` to the script."""
    if isinstance(value, dict):
        return lua.table_from({k: to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, v) for v in value])
    return value


def health(obj: dict, script: str = LUA) -> tuple[str, str]:
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    fn = lua.eval("function(obj) " + script + " end")
    result = fn(to_lua(lua, obj))
    return result["status"], result["message"]


def cond(type_: str, status: str, reason: str = "Reason", message: str = "", generation: int | None = 3) -> dict:
    c = {"type": type_, "status": status, "reason": reason, "message": message,
         "lastTransitionTime": "2026-11-25T10:00:00Z"}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def isvc(generation: int = 3, status: dict | None = None) -> dict:
    obj = {"apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "chat", "namespace": "team-a", "generation": generation},
           "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}}}
    if status is not None:
        obj["status"] = status
    return obj


CASES = {
    "no status yet": (isvc(status=None), "Progressing"),
    "status without conditions": (isvc(status={"observedGeneration": 3}), "Progressing"),
    "ready for the current generation": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "True", "AllReplicasReady", "2/2 replicas ready"), cond("Reconciling", "False"),
            cond("Stalled", "False"), cond("Sized", "True")]}), "Healthy"),
    "ready, conditions without their own observedGeneration": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "True", generation=None), cond("Sized", "True", generation=None)]}), "Healthy"),
    "ready but for an older generation (spec just edited)": (
        isvc(generation=4, status={"observedGeneration": 3, "conditions": [
            cond("Ready", "True"), cond("Sized", "True")]}), "Progressing"),
    "status generation current but Ready condition stale": (
        isvc(generation=4, status={"observedGeneration": 4, "conditions": [
            cond("Ready", "True", generation=3)]}), "Progressing"),
    "reconciling (rollout in progress)": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "False", "ReplicasNotReady", "1/2 replicas ready"),
            cond("Reconciling", "True", "RollingOut", "updating Deployment chat")]}), "Progressing"),
    "reconciling wins over a still-true Ready": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "True"), cond("Reconciling", "True", "Scaling")]}), "Progressing"),
    "not ready, nothing else said": (
        isvc(status={"observedGeneration": 3, "conditions": [cond("Ready", "False", "Pending")]}), "Progressing"),
    "stalled": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "False"), cond("Stalled", "True", "SecretNotFound", "Secret chat-keys not found")]}),
        "Degraded"),
    "stalled even while Ready is still true from before": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "True"), cond("Stalled", "True", "SecretNotFound")]}), "Degraded"),
    "infeasible model": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "False"), cond("Sized", "False", "InsufficientGPUMemory", "needs 141 GB")]}),
        "Degraded"),
    "stalled for an older generation, new spec not yet observed": (
        isvc(generation=4, status={"observedGeneration": 3, "conditions": [
            cond("Stalled", "True", "SecretNotFound")]}), "Progressing"),
    "stalled condition left from an older generation": (
        isvc(generation=4, status={"observedGeneration": 4, "conditions": [
            cond("Stalled", "True", "SecretNotFound", generation=3),
            cond("Reconciling", "True", "Progressing", generation=4)]}), "Progressing"),
    "quota-limited but ready": (
        isvc(status={"observedGeneration": 3, "conditions": [
            cond("Ready", "True"), cond("QuotaLimited", "True", "GPUQuota", "capped at 2 replicas"),
            cond("Sized", "True")]}), "Healthy"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_health_of_status_fixture(name: str) -> None:
    obj, expected = CASES[name]
    status, message = health(obj)
    assert status == expected, f"{name}: got {status} ({message})"
    assert isinstance(message, str) and message


def test_degraded_message_names_reason_and_message() -> None:
    status, message = health(CASES["infeasible model"][0])
    assert status == "Degraded"
    assert "InsufficientGPUMemory" in message and "needs 141 GB" in message


def test_progressing_message_names_the_unobserved_generation() -> None:
    _, message = health(CASES["ready but for an older generation (spec just edited)"][0])
    assert "4" in message


def test_argocd_cm_snippet_embeds_the_same_lua() -> None:
    doc = yaml.safe_load((ARGOCD / "argocd-cm-patch.yaml").read_text())
    assert doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "argocd-cm"
    embedded = doc["data"][HEALTH_KEY]
    assert embedded.strip() == LUA.strip()
    # And the embedded copy behaves the same (it is what Argo CD actually runs).
    assert health(CASES["stalled"][0], embedded)[0] == "Degraded"


def test_gopher_lua_agrees_on_every_fixture() -> None:
    """What Argo CD would show: gopher-lua's verdict for each fixture is the expected one, and its message
    is the same text lupa produces (one process for all fixtures)."""
    names = list(CASES)
    results = lua_health(LUA_FILE, [CASES[n][0] for n in names])
    for name, got in zip(names, results, strict=True):
        assert "error" not in got, f"{name}: {got['error']}"
        assert got["status"] == CASES[name][1], f"{name}: gopher-lua says {got}"
        assert got["message"] == health(CASES[name][0])[1], name


def test_gopher_lua_runs_the_argocd_cm_snippet(tmp_path: Path) -> None:
    embedded = yaml.safe_load((ARGOCD / "argocd-cm-patch.yaml").read_text())["data"][HEALTH_KEY]
    script = tmp_path / "embedded.lua"
    script.write_text(embedded)
    got = lua_health(script, [CASES["stalled"][0], CASES["ready for the current generation"][0]])
    assert [g["status"] for g in got] == ["Degraded", "Healthy"], got


def test_gopher_lua_reports_a_script_error(tmp_path: Path) -> None:
    """The harness can fail: a script that indexes nil is an error, not a verdict."""
    script = tmp_path / "broken.lua"
    script.write_text("return obj.nothing.here")
    got = lua_health(script, [CASES["stalled"][0]])[0]
    assert "error" in got and "status" not in got, got
