"""Readiness (/health) and liveness (/live): what the pod's probes ask, answered from facts.

- /health (readiness, what the Service routes on): 200 only while the server is ready AND the engine
  core is making progress: with requests in the core, a step's outputs arrived within
  `readiness_stall_s`. 503 while loading, draining, dead, or stalled; it turns 200 again by itself as
  soon as steps resume.
- /live (liveness): 200 unless the engine core is dead or has been stalled for `liveness_stall_s`
  (longer than readiness: a slow moment takes the pod out of the Service first; only a wedge that lasts
  restarts it). Loading and draining are alive: the startup probe covers model load, and a restart mid
  drain would cut the streams the drain is finishing.

Both are flags (and TOKENMILL_* variables) of `tokenmill serve`; docs/reliability.md has the timings.
"""

from dataclasses import dataclass

from fastapi.responses import JSONResponse
from tokenmill.engine.config import DEFAULT_LIVENESS_STALL_S, DEFAULT_READINESS_STALL_S
from tokenmill.engine.server.state import ServerState

__all__ = ["DEFAULT_LIVENESS_STALL_S", "DEFAULT_READINESS_STALL_S", "HealthConfig", "liveness", "readiness"]


@dataclass(slots=True)
class HealthConfig:
    readiness_stall_s: float = DEFAULT_READINESS_STALL_S
    liveness_stall_s: float = DEFAULT_LIVENESS_STALL_S


def _stall(state: ServerState) -> tuple[float, int]:
    engine = state.engine
    if engine is None:
        return 0.0, 0
    return engine.stalled_for(), engine.num_in_core


def _stalled_body(stalled: float, in_core: int, bound: float) -> dict[str, str]:
    return {
        "status": "stalled",
        "detail": f"the engine core has made no progress for {stalled:.1f}s with {in_core} requests in it "
        f"(bound {bound:g}s)",
    }


def readiness(state: ServerState, cfg: HealthConfig) -> JSONResponse:
    if state.status != "ready":
        return JSONResponse({"status": state.status, "detail": state.status_detail}, status_code=503)
    stalled, in_core = _stall(state)
    if stalled > cfg.readiness_stall_s:
        return JSONResponse(_stalled_body(stalled, in_core, cfg.readiness_stall_s), status_code=503)
    return JSONResponse({"status": "ok"})


def liveness(state: ServerState, cfg: HealthConfig) -> JSONResponse:
    if state.status in ("dead", "failed"):
        return JSONResponse({"status": state.status, "detail": state.status_detail}, status_code=503)
    stalled, in_core = _stall(state)
    if stalled > cfg.liveness_stall_s:
        return JSONResponse(_stalled_body(stalled, in_core, cfg.liveness_stall_s), status_code=503)
    return JSONResponse({"status": "alive"})
