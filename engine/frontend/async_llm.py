"""AsyncLLM: the API process's side of the engine.

It tokenizes and applies chat templates through a TokenizerPool (tokenizer_pool.py: one worker thread,
so a long prompt never stalls the event loop that feeds every other stream), counts admission, turns
the core's token ids into text with the OutputProcessor, and hands each request its outputs through its
own asyncio queue. A request whose consumer goes away (client disconnect, cancellation) is aborted in
the core, which frees its blocks.

Admission: a request counts as waiting from the moment it is admitted (before tokenization) until the
scheduler first runs it; with `max_waiting_requests` already waiting, `admit` raises QueueFullError.

Progress: the core sends one message per step while it has work, so the time since the last one that
moved anything (tokens computed, outputs, a grammar compiling), while requests are in the core, says
whether it is moving (`stalled_for`). A core that loops without scheduling anything (a scheduler
deadlock) is as stalled as a frozen one. That costs nothing per step: the message exists anyway.
/health and /live read it (see docs/reliability.md).
"""

import asyncio
import copy
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.client import (
    EngineDeadError,
    EngineInfo,
    RejectedRequest,
    StepOutputs,
    UtilityResult,
)
from tokenmill.engine.frontend.output_processor import OutputProcessor, merge_delta
from tokenmill.engine.frontend.tokenizer_pool import TokenizerPool
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.outputs import RequestOutput, RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(
            f"the server is overloaded: {num_waiting} requests are already waiting "
            f"(--max-waiting-requests {limit}); retry later"
        )


class LoRAPoolFullError(Exception):
    def __init__(self, name: str, in_use: list[str], limit: int) -> None:
        super().__init__(
            f"LoRA adapter {name!r} cannot be served now: the {limit} adapters the engine keeps in memory "
            f"(--max-cpu-loras {limit}) all have requests in flight ({', '.join(sorted(in_use))}); retry later"
        )


class RequestRejectedError(Exception):
    """The engine core refused the request; client_error says whose fault it was."""

    def __init__(self, message: str, client_error: bool) -> None:
        super().__init__(message)
        self.client_error = client_error


class RequestAbortedError(Exception):
    """The server aborted the request (shutdown grace period exceeded)."""


@dataclass(slots=True)
class _RequestState:
    queue: asyncio.Queue
    arrival_time: float  # time.monotonic(), the clock the scheduler's queue times use
    num_prompt_tokens: int
    n: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class AsyncLLM:
    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        info: EngineInfo,
        *,
        max_waiting_requests: int | None = None,
        max_cpu_loras: int = 0,
        metrics: Any = None,
        on_dead: Callable[[EngineDeadError], None] | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        self.max_model_len: int = info.capacity.max_model_len
        self.max_waiting_requests = max_waiting_requests
        # LoRA: adapter name -> admitted requests under it. At most max_cpu_loras adapters have requests
        # in flight, so every rank's host cache holds all of them (no adapter is read from disk again
        # while its requests wait); a request for one more is refused (LoRAPoolFullError).
        self.max_cpu_loras = max_cpu_loras
        self._lora_in_flight: dict[str, int] = {}
        self._lora_of: dict[str, str] = {}  # request id -> adapter name
        self.metrics = metrics
        self.on_dead = on_dead
        # The detokenizer gets its own copy: the tokenizer thread and the event loop never share one.
        self.processor = OutputProcessor(copy.deepcopy(tokenizer))
        self.tokenizers = TokenizerPool(tokenizer)
        self._states: dict[str, _RequestState] = {}
        self._unscheduled: set[str] = set()  # admitted, not yet run by the scheduler
        self._preprocessing: set[str] = set()  # admitted, not yet sent to the core
        self._in_flight: set[str] = set()  # admitted, response not finished
        self.dead_error: EngineDeadError | None = None
        self._abort_reason: str | None = None  # set by abort_all: nothing new may start
        self._output_task: asyncio.Task | None = None
        # When the core last showed progress: a step's outputs arrived, or it was handed work while idle.
        self._last_progress = time.monotonic()
        self._utility_calls: dict[int, asyncio.Future] = {}  # call id -> its answer (call_utility)
        self._call_ids = itertools.count()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._output_task = asyncio.get_running_loop().create_task(self._output_loop(), name="engine-outputs")

    async def close(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        self.tokenizers.shutdown()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_unscheduled(self) -> int:
        return len(self._unscheduled)

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds the core has had requests without sending a step's outputs (0 when it has none)."""
        if not self._states:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self._last_progress)

    @property
    def num_in_core(self) -> int:
        return len(self._states)

    # ---- admission -----------------------------------------------------------------------------
    def admit(self, request_ids: list[str], lora: LoRARequest | None = None) -> None:
        """Count requests as waiting before any work is done for them; raise QueueFullError if full, or
        LoRAPoolFullError when their adapter would be one more than the host cache holds."""
        if self.dead_error is not None:
            raise self.dead_error
        limit = self.max_waiting_requests
        if limit is not None and len(self._unscheduled) >= limit:
            raise QueueFullError(len(self._unscheduled), limit)
        if lora is not None:
            name = lora.lora_name
            if name not in self._lora_in_flight and len(self._lora_in_flight) >= self.max_cpu_loras:
                raise LoRAPoolFullError(name, list(self._lora_in_flight), self.max_cpu_loras)
            self._lora_in_flight[name] = self._lora_in_flight.get(name, 0) + len(request_ids)
            self._lora_of.update((rid, name) for rid in request_ids)
        self._unscheduled.update(request_ids)
        self._preprocessing.update(request_ids)
        self._in_flight.update(request_ids)

    def release(self, request_ids: list[str]) -> None:
        """Forget admitted requests that will not (or no longer) run. Idempotent."""
        for rid in request_ids:
            self._unscheduled.discard(rid)
            self._preprocessing.discard(rid)
            self._in_flight.discard(rid)
            name = self._lora_of.pop(rid, None)
            if name is not None:
                self._lora_in_flight[name] -= 1
                if not self._lora_in_flight[name]:
                    del self._lora_in_flight[name]

    # ---- tokenization (TokenizerPool's worker thread) -----------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.tokenizers.encode(text, add_special_tokens)

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        return await self.tokenizers.apply_chat_template(messages, add_generation_prompt, tools)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self.tokenizers.decode(token_ids, skip_special_tokens)

    # ---- generation ----------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """RequestOutputs of one admitted request (cumulative, deltas or only the final one, per
        output_kind), the last with finished=True. Closing or cancelling the generator early aborts
        the request in the core."""
        done = False
        try:
            if self.dead_error is not None:
                raise self.dead_error
            if self._abort_reason is not None:
                raise RequestAbortedError(self._abort_reason)
            state = _RequestState(
                asyncio.Queue(),
                time.monotonic() if arrival_time is None else arrival_time,
                len(prompt_token_ids),
                params.n,
            )
            if not self._states:  # the core was idle: its stall clock starts now, not at its last step
                self._last_progress = time.monotonic()
            self._states[request_id] = state
            self.processor.add_request(
                request_id, prompt, prompt_token_ids, params, state.arrival_time, output_kind
            )
            self._preprocessing.discard(request_id)
            self.client.add_request(
                EngineCoreRequest(
                    request_id, list(prompt_token_ids), params, state.arrival_time, priority, cache_salt,
                    lora_request,
                )
            )
            while True:
                item = await state.queue.get()
                # A consumer that fell behind needs only the newest cumulative output, or the deltas
                # merged into one.
                while not state.queue.empty() and not isinstance(item, BaseException):
                    nxt = state.queue.get_nowait()
                    delta = output_kind == RequestOutputKind.DELTA and not isinstance(nxt, BaseException)
                    item = merge_delta(item, nxt) if delta else nxt
                if isinstance(item, BaseException):
                    done = True  # nothing of it is left in the core
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(request_id)
            self.release([request_id])

    def abort(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        self.release([request_id])
        if state is None:
            return
        self.processor.abort_request(request_id)
        self.client.abort_requests([request_id])
        if self.metrics is not None:
            now = time.monotonic()
            self.metrics.record_finished(
                now - state.arrival_time,
                state.num_prompt_tokens,
                state.num_generation_tokens,
                ["abort"] * state.n,
            )

    def abort_all(self, reason: str) -> int:
        """Abort every request (shutdown); their consumers, and any that try to start, get
        RequestAbortedError."""
        self._abort_reason = reason
        ids = list(self._states)
        for rid in ids:
            state = self._states.pop(rid)
            self.processor.abort_request(rid)
            state.queue.put_nowait(RequestAbortedError(reason))
        if ids:
            self.client.abort_requests(ids)
        return len(ids)

    # ---- calls into the core --------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run one of the engine core's utility methods (core/wire.py's UTILITY_METHODS) between two of
        its steps; its result, or RuntimeError with the core's message."""
        if self.dead_error is not None:
            raise self.dead_error
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            self.client.call_utility(call_id, method, list(args))
            return await future
        finally:
            self._utility_calls.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (nothing changed) while requests hold blocks."""
        return bool(await self.call_utility("reset_prefix_cache"))

    # ---- the output loop -----------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                item = await self.client.get_output()
                if isinstance(item, RejectedRequest):
                    self._reject(item)
                elif isinstance(item, UtilityResult):
                    self._utility_done(item)
                else:
                    self._process_step(item)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:
            logger.exception("processing engine outputs failed")
            self._fail_all(EngineDeadError(f"processing engine outputs failed: {type(e).__name__}: {e}"))

    def _utility_done(self, item: UtilityResult) -> None:
        future = self._utility_calls.get(item.call_id)
        if future is None or future.done():  # its caller went away
            return
        if item.ok:
            future.set_result(item.value)
        else:
            future.set_exception(RuntimeError(item.value))

    def _reject(self, item: RejectedRequest) -> None:
        state = self._states.pop(item.request_id, None)
        self.release([item.request_id])
        if state is not None:
            self.processor.abort_request(item.request_id)
            state.queue.put_nowait(RequestRejectedError(item.message, item.client_error))

    def _process_step(self, step: StepOutputs) -> None:
        now = time.monotonic()
        if step.outputs or step.stats.num_scheduled_tokens or step.stats.num_compiling:
            self._last_progress = now
        for rid, _waited in step.stats.queue_times:
            self._unscheduled.discard(rid)
        outputs = [
            o for o in step.outputs if o.request_id in self._states
        ]  # drop late tokens of aborted ones
        num_new_tokens = 0
        touched: set[str] = set()
        for o in outputs:
            num_new_tokens += len(o.new_token_ids)
            self._states[o.request_id].num_generation_tokens += len(o.new_token_ids)
            touched.add(o.request_id)
        for rid in touched:
            state = self._states[rid]
            self._unscheduled.discard(rid)
            if self.metrics is not None:
                if state.first_token_time is None:
                    self.metrics.record_first_token(now - state.arrival_time, state.num_prompt_tokens)
                else:
                    self.metrics.record_inter_token(now - state.last_token_time)
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now

        request_outputs, to_abort = self.processor.process_outputs(outputs)
        if to_abort:
            self.client.abort_requests(to_abort)
        for ro in request_outputs:
            state = self._states[ro.request_id]
            state.queue.put_nowait(ro)
            if ro.finished:
                del self._states[ro.request_id]
                self._unscheduled.discard(ro.request_id)
                if self.metrics is not None:
                    self.metrics.record_finished(
                        now - state.arrival_time,
                        state.num_prompt_tokens,
                        ro.metrics["num_generation_tokens"],
                        [c.finish_reason or "abort" for c in ro.outputs],
                    )
        if self.metrics is not None:
            self.metrics.record_step(step.stats, num_new_tokens, len(self._preprocessing))

    def _fail_all(self, err: EngineDeadError) -> None:
        logger.error("engine core is dead: %s; failing %d in-flight requests", err, len(self._states))
        self.dead_error = err
        for rid, state in list(self._states.items()):
            state.queue.put_nowait(err)
            self.processor.abort_request(rid)
        self._states.clear()
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(err)
        if self.on_dead is not None:
            self.on_dead(err)
