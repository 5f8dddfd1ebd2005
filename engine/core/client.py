"""The one engine client the HTTP layer talks to, in two shapes with the same methods:

- MPClient: the engine core in a child process (proc.py), ZeroMQ + msgpack over ipc:// sockets in
  a private temp dir. A receiver thread decodes outputs and watches the child; if the child exits
  unexpectedly the next get_output() raises EngineDeadError within about 0.1 s.
- InprocClient: the same busy loop in a background thread of this process (tests, debugging).

Both: `await start() -> EngineInfo` (raises EngineStartupError), `add_request(req)`,
`abort_requests(ids)`, `call_utility(call_id, method, args)` (answered by a UtilityResult),
`await get_output() -> StepOutputs | RejectedRequest | UtilityResult` (raises EngineDeadError),
`shutdown()`, and `pid` (the core's process id, or None in-process).
"""

import asyncio
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCoreOutput, EngineCoreRequest, SchedulerStats, proc, wire
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
    UTILITY_RESULT,
)

logger = logging.getLogger(__name__)

DEAD = "dead"  # client-side only: the core process exited without being asked to
RECEIVER_POLL_MS = 100  # bounds how long a dead core goes unnoticed


class EngineStartupError(RuntimeError):
    """The engine core could not start (bad model, KV pool too small, ...); the message says why."""


class EngineDeadError(RuntimeError):
    """The engine core stopped while the server was running; every in-flight request fails with this."""


@dataclass(slots=True)
class EngineInfo:
    capacity: Any  # EngineCapacity (kept as Any so this module needs no torch)
    eos_token_ids: list[int]


@dataclass(slots=True)
class StepOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


@dataclass(slots=True)
class RejectedRequest:
    request_id: str
    message: str
    client_error: bool  # True: the request was invalid (400); False: the engine failed on it (500)


@dataclass(slots=True)
class UtilityResult:
    call_id: int
    ok: bool
    value: Any  # the method's result, or the error's message when not ok


def _exit_description(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class _OutputQueue:
    """Messages from the core (any thread) to the event loop, translated for the caller."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple] = asyncio.Queue()
        self.dead: str | None = None

    def put_threadsafe(self, msg: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, msg)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def first(self) -> EngineInfo:
        msg = await self.queue.get()
        if msg[0] == READY:
            return EngineInfo(msg[1], list(msg[2]))
        raise EngineStartupError(msg[1])

    async def next(self) -> StepOutputs | RejectedRequest | UtilityResult:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        msg = await self.queue.get()
        kind = msg[0]
        if kind == OUTPUTS:
            return StepOutputs(msg[1], msg[2])
        if kind == REJECT:
            return RejectedRequest(msg[1], msg[2], msg[3])
        if kind == UTILITY_RESULT:
            return UtilityResult(msg[1], msg[2], msg[3])
        self.dead = msg[1]
        raise EngineDeadError(self.dead)


# ---- in-process --------------------------------------------------------------------------------
class InprocClient:
    pid = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._inputs: queue.Queue[tuple] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._out: _OutputQueue | None = None

    async def start(self) -> EngineInfo:
        self._out = _OutputQueue()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()
        return await self._out.first()

    def _run(self) -> None:
        out = self._out
        try:
            from tokenmill.engine.core.engine_core import EngineCore

            core = EngineCore(self.config)
        except Exception as e:
            out.put_threadsafe((STARTUP_ERROR, proc.startup_error_message(e)))
            return
        self.core = core  # tests read block accounting through it
        out.put_threadsafe((READY, core.capacity, list(core.eos_token_ids)))
        try:
            proc.run_busy_loop(core, self._recv, out.put_threadsafe)
            core.shutdown()
        except Exception as e:
            logger.error("engine core failed:\n%s", traceback.format_exc())
            out.put_threadsafe((FATAL, f"engine core failed: {type(e).__name__}: {e}"))

    def _recv(self, timeout_s: float) -> list[tuple]:
        msgs = []
        try:
            msgs.append(self._inputs.get(timeout=timeout_s) if timeout_s > 0 else self._inputs.get_nowait())
            while True:
                msgs.append(self._inputs.get_nowait())
        except queue.Empty:
            return msgs

    def add_request(self, req: EngineCoreRequest) -> None:
        if self._out.dead is not None:
            raise EngineDeadError(self._out.dead)
        self._inputs.put((ADD, req))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inputs.put((ABORT, list(request_ids)))

    def call_utility(self, call_id: int, method: str, args: list) -> None:
        if self._out.dead is not None:
            raise EngineDeadError(self._out.dead)
        self._inputs.put((UTILITY, call_id, method, list(args)))

    async def get_output(self) -> StepOutputs | RejectedRequest | UtilityResult:
        return await self._out.next()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._inputs.put((SHUTDOWN,))
        if self._thread is not None:
            self._thread.join(timeout_s)


# ---- multiprocess ------------------------------------------------------------------------------
class MPClient:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self.config = config
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self._out: _OutputQueue | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._dir: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def launch(self) -> None:
        """Start the core process (no event loop needed): `tokenmill serve` calls this before its own
        imports, so that the core's imports and model load overlap them. start() calls it if not done."""
        import zmq

        self._dir = tempfile.mkdtemp(prefix="tokenmill-ipc-")
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy core
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)
        cmd = [
            sys.executable, "-m", "tokenmill.engine.core.proc",
            "--input-addr", input_addr,
            "--output-addr", output_addr,
            "--config-json", json.dumps(asdict(self.config)),
            "--parent-pid", str(os.getpid()),
            "--log-level", self.log_level,
        ]  # fmt: skip
        # Its own session: a Ctrl-C in the terminal reaches only the API process, which then shuts the
        # core down in order instead of both dying at once.
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        logger.info("engine core process started (pid %d)", self.proc.pid)

    async def start(self) -> EngineInfo:
        if self.proc is None:
            self.launch()
        self._out = _OutputQueue()  # what the core sent meanwhile waits in the output socket
        self._thread = threading.Thread(target=self._receive_loop, name="engine-core-receiver", daemon=True)
        self._thread.start()
        return await self._out.first()

    def _receive_loop(self) -> None:
        import zmq

        sock, out = self._output, self._out
        while True:
            if sock.poll(RECEIVER_POLL_MS):
                while True:
                    try:
                        out.put_threadsafe(wire.decode(sock.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
            returncode = self.proc.poll()
            if returncode is None:
                continue
            while sock.poll(50):  # what it sent before dying (a FATAL message, say) comes first
                out.put_threadsafe(wire.decode(sock.recv()))
            if not self._closing:
                out.put_threadsafe(
                    (DEAD, f"the engine core process (pid {self.proc.pid}) {_exit_description(returncode)}")
                )
            return

    def _send(self, msg: tuple) -> None:
        import zmq

        if self._out is not None and self._out.dead is not None:
            raise EngineDeadError(self._out.dead)
        try:
            self._input.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # no connected peer: the core is gone and the receiver is about to say so
            raise EngineDeadError("the engine core process is not accepting requests") from None

    def add_request(self, req: EngineCoreRequest) -> None:
        self._send((ADD, req))

    def abort_requests(self, request_ids: list[str]) -> None:
        try:
            self._send((ABORT, list(request_ids)))
        except EngineDeadError:
            pass  # a dead core holds nothing to free

    def call_utility(self, call_id: int, method: str, args: list) -> None:
        self._send((UTILITY, call_id, method, list(args)))

    async def get_output(self) -> StepOutputs | RejectedRequest | UtilityResult:
        return await self._out.next()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core and free the sockets; a second call does nothing."""
        if self.proc is None or self._closing:
            return
        self._closing = True
        if self.proc.poll() is None:
            try:
                self._send((SHUTDOWN,))
            except EngineDeadError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("engine core did not exit within %.0fs; killing it", timeout_s)
                self.proc.kill()
                self.proc.wait()
        if self._thread is not None:
            self._thread.join(2.0)
        self._input.close()
        self._output.close()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
