"""uvicorn with tokenmill's shutdown: drain on SIGTERM/SIGINT (503s for new requests, in-flight ones get
the grace period), and exit codes that say what happened (0 drained, 1 the engine died or failed to start).
"""

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn
from tokenmill.engine.server.state import ServerState

logger = logging.getLogger("tokenmill.serve")


class Server(uvicorn.Server):
    """uvicorn with tokenmill's shutdown: drain on SIGTERM/SIGINT, exit codes that say what happened."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_period_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_period_s = grace_period_s
        self.exit_code = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would close the listener at once (no 503s) and re-raise the signal at exit
        # (exit status -15 instead of 0).
        if self._draining:
            if sig == signal.SIGINT:  # a second Ctrl-C: stop waiting
                self.force_exit = self.should_exit = True
            return
        self._draining = True
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain(signal.Signals(sig).name)))

    async def drain(self, why: str) -> None:
        state, engine = self.state, self.state.engine
        if state.status in ("ready", "loading"):
            state.status, state.status_detail = "draining", "the server is shutting down"
        if engine is None:
            logger.info("received %s before the model was ready; exiting", why)
            self.should_exit = True
            return
        logger.info(
            "received %s: no new requests; %d in flight get up to %.0fs to finish",
            why,
            engine.num_in_flight,
            self.grace_period_s,
        )
        deadline = time.monotonic() + self.grace_period_s
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            n = engine.abort_all(
                f"the server is shutting down and the grace period of {self.grace_period_s:.0f}s has passed"
            )
            logger.warning("grace period over: aborted %d requests", n)
            settle = time.monotonic() + 2.0  # let the handlers write their answers
            while engine.num_in_flight and time.monotonic() < settle:
                await asyncio.sleep(0.05)
        logger.info("drained; shutting down")
        self.should_exit = True

    def exit_soon(self, code: int, delay_s: float = 0.0) -> None:
        self.exit_code = code

        def stop() -> None:
            self.should_exit = True

        if self._loop is not None:
            self._loop.call_later(delay_s, stop)
        else:
            stop()
