"""The engine-core process: a busy loop around EngineCore, apart from HTTP and tokenization.

The API process binds two ZeroMQ PUSH/PULL sockets on ipc:// paths and starts this module as a child
(`python -m tokenmill.engine.core.proc`). The child loads the model, answers READY with its capacity
(or STARTUP_ERROR with the reason), then loops: take every queued add/abort, run one step while there
is work, send the step's outputs with its SchedulerStats. It exits on SHUTDOWN, or when its parent is
gone (it is never left running on its own).

The messages and their encoding are wire.py's.
"""

import argparse
import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCoreRequest, SchedulerStats
from tokenmill.engine.core.wire import (
    ABORT,
    ADD,
    FATAL,
    OUTPUTS,
    READY,
    REJECT,
    SHUTDOWN,
    STARTUP_ERROR,
    UTILITY,
    UTILITY_METHODS,
    UTILITY_RESULT,
    decode,
    encode,
)

logger = logging.getLogger("tokenmill.engine.core")
# The core process runs this module first; the few light imports above are all it has done so far, so
# the engine core's start-up "imports" phase counts from here.
_STARTED = time.monotonic()


IDLE_POLL_S = 0.5  # how long an idle core blocks waiting for input before checking on its parent
PARENT_CHECK_S = 1.0  # how often a busy core checks on its parent


def startup_error_message(e: Exception) -> str:
    """A configuration problem (ValueError, missing file) is the user's to fix: its message says how, and
    a traceback would only bury it. Anything else is a bug: log the traceback."""
    if isinstance(e, ValueError | FileNotFoundError):
        logger.error("engine startup failed: %s", e)
        return str(e)
    logger.error("engine startup failed:\n%s", traceback.format_exc())
    return f"{type(e).__name__}: {e}"


# ---- the loop ------------------------------------------------------------------------------------
def idle_stats(core: Any) -> SchedulerStats:
    """Stats when nothing runs (after an abort that emptied the core): the gauges must read zero."""
    return SchedulerStats(kv_cache_usage=core.num_kv_blocks_in_use() / core.capacity.num_kv_blocks)


def _add(core: Any, req: EngineCoreRequest, send: Callable[[tuple], None]) -> None:
    try:
        core.add_request(req)
    except ValueError as e:
        send((REJECT, req.request_id, str(e), True))
    except Exception as e:  # a bug, not the client's fault; the core stays usable for the others
        logger.exception("add_request(%s) failed", req.request_id)
        send((REJECT, req.request_id, f"{type(e).__name__}: {e}", False))


def _utility(core: Any, call_id: int, method: str, args: list, send: Callable[[tuple], None]) -> None:
    if method not in UTILITY_METHODS:
        send((UTILITY_RESULT, call_id, False, f"unknown engine core method {method!r}"))
        return
    try:
        send((UTILITY_RESULT, call_id, True, getattr(core, method)(*args)))
    except Exception as e:
        logger.exception("engine core method %s failed", method)
        send((UTILITY_RESULT, call_id, False, f"{type(e).__name__}: {e}"))


def run_busy_loop(
    core: Any,
    recv: Callable[[float], list[tuple]],
    send: Callable[[tuple], None],
    parent_alive: Callable[[], bool] = lambda: True,
) -> str:
    """Run until SHUTDOWN ("shutdown") or parent death ("orphaned"). recv(timeout_s) returns every
    queued message, waiting up to timeout_s for the first one (0: do not wait)."""
    next_parent_check = time.monotonic() + PARENT_CHECK_S
    while True:
        busy = core.has_unfinished_requests()
        msgs = recv(0.0 if busy else IDLE_POLL_S)
        if time.monotonic() >= next_parent_check:
            next_parent_check = time.monotonic() + PARENT_CHECK_S
            if not parent_alive():
                logger.error("the API process is gone; engine core exiting")
                return "orphaned"
        aborted = False
        for msg in msgs:
            kind = msg[0]
            if kind == SHUTDOWN:
                return "shutdown"
            if kind == ADD:
                _add(core, msg[1], send)
            elif kind == ABORT:
                core.abort_requests(msg[1])
                aborted = True
            elif kind == UTILITY:
                _utility(core, msg[1], msg[2], msg[3], send)
        if core.has_unfinished_requests():
            outputs, stats = core.step()
            send((OUTPUTS, outputs, stats))
        elif aborted:
            send((OUTPUTS, [], idle_stats(core)))


# ---- process entry point -------------------------------------------------------------------------
def _zmq_recv(sock: Any) -> Callable[[float], list[tuple]]:
    import zmq

    def recv(timeout_s: float) -> list[tuple]:
        msgs: list[tuple] = []
        if not sock.poll(int(timeout_s * 1000)):
            return msgs
        while True:
            try:
                msgs.append(decode(sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return msgs

    return recv


def main(argv: list[str] | None = None) -> int:
    import zmq

    ap = argparse.ArgumentParser(prog="tokenmill-engine-core")
    ap.add_argument("--input-addr", required=True)
    ap.add_argument("--output-addr", required=True)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)  # flush the last messages, but never block exit on a dead parent
    out.connect(args.output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(args.input_addr)

    def send(msg: tuple) -> None:
        out.send(encode(msg))

    def parent_alive() -> bool:
        return os.getppid() == args.parent_pid

    try:
        try:
            from tokenmill.engine.core.capacity import StartupTimer
            from tokenmill.engine.core.engine_core import EngineCore

            timer = StartupTimer(_STARTED)
            core = EngineCore(EngineConfig(**json.loads(args.config_json)), timer)
        except Exception as e:
            send((STARTUP_ERROR, startup_error_message(e)))
            return 1
        send((READY, core.capacity, list(core.eos_token_ids)))
        try:
            socket_dir = os.path.dirname(args.input_addr.removeprefix("ipc://"))
            orphaned = run_busy_loop(core, _zmq_recv(inp), send, parent_alive) == "orphaned"
            core.shutdown()  # the last KV events go out; the other ranks stop
            if orphaned and os.path.basename(socket_dir).startswith("tokenmill-ipc-"):
                shutil.rmtree(socket_dir, ignore_errors=True)  # the dead parent cannot remove it any more
        except Exception as e:
            logger.error("engine core failed:\n%s", traceback.format_exc())
            send((FATAL, f"{type(e).__name__}: {e}"))
            return 1
        return 0
    finally:
        inp.close()
        out.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
