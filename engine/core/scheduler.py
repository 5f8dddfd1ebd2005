"""The Scheduler: one scheduling decision per step under a token budget and a sequence cap, and the
bookkeeping after the step (update_from_output: tokens appended, stops checked, finished sequences freed).
It and the KVCacheManager are the only owners of the request lists and the blocks.

Running sequences first (a decode token each, or their next prefill chunk), then waiting ones.
Recompute preemption when blocks run out; nobody new is admitted in a step that preempted.

LoRA: a step never runs more distinct adapters than there are slots (max_loras): every running sequence's
adapter holds a slot, so a waiting sequence whose adapter is not running is admitted only while fewer than
max_loras adapters run. One that cannot get a slot waits, and so does every later (queue-order) sequence
of any adapter, even one that is running: otherwise a stream of requests for the running adapters could
keep their slots forever and starve it. Base-model sequences need no slot and are admitted past it.

Only one kind of waiting sequence holds blocks: an n > 1 choice forked from its parent's prompt and not
yet run (_fork_children). When the head of the queue cannot get its blocks, those are
taken back (recompute preemption while waiting), or the head could wait forever on sequences queued
behind it: the soak test's deadlock.
"""

import heapq
import time
from dataclasses import dataclass, field

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCoreOutput, SchedulerStats
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.structured_output.manager import accept_token


@dataclass(slots=True)
class SchedulerOutput:
    # (sequence, number of tokens to compute this step), running sequences first
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    queue_times: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counters behind LLM.stats() and the benchmarks."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hit_tokens: int = 0
    sum_running_seqs: int = 0
    sum_kv_utilization: float = 0.0


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_loras = config.max_loras if config.enable_lora else 0
        self.kv = kv
        self.waiting: list[Request] = []  # a heap ordered by (priority, arrival, seq_no)
        self.running: list[Request] = []
        self.requests: dict[str, list[Request]] = {}  # request id -> its live sequences
        self.counters = EngineCounters()

    # ---- bookkeeping ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue choice 0 of a request; its other choices (req.fork_children) are known from now on and
        queued once choice 0's prompt is computed (they share its prompt blocks)."""
        self.requests.setdefault(req.request_id, []).extend([req, *req.fork_children])
        self.counters.num_prompt_tokens += req.num_prompt_tokens
        heapq.heappush(self.waiting, req)

    def add_request_seq(self, req: Request) -> None:
        """Queue a sequence of an already-known request (a forked n > 1 choice)."""
        heapq.heappush(self.waiting, req)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def reset_counters(self) -> None:
        self.counters = EngineCounters()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark a sequence finished and free its blocks (also its not-yet-forked siblings)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv.free(req)
        seqs = self.requests.get(req.request_id)
        if seqs is not None:
            seqs.remove(req)
            if not seqs:
                del self.requests[req.request_id]

    def abort(self, request_id: str) -> list[Request]:
        """Remove every sequence of a request, wherever it is. Returns the removed sequences."""
        seqs = list(self.requests.get(request_id, []))
        for r in seqs:
            r.fork_children = []
            if r.status is RequestStatus.RUNNING:
                self.running.remove(r)
            elif r in self.waiting:
                self.waiting.remove(r)
                heapq.heapify(self.waiting)
            self.finish(r, "abort")
        return seqs

    # ---- the decision --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled = True
            while not self.kv.allocate_slots(req, num_new):
                victim = self._pick_victim(scheduled_ids)
                j = self.running.index(victim)
                if id(victim) in scheduled_ids:  # give back its slot in this step
                    scheduled_ids.discard(id(victim))
                    k = next(k for k, (r, _) in enumerate(out.scheduled) if r is victim)
                    budget += out.scheduled.pop(k)[1]
                self._preempt(victim)
                out.num_preemptions += 1
                if victim is req:
                    scheduled = False
                    break
                if j < i:
                    i -= 1
            if scheduled:
                out.scheduled.append((req, num_new))
                scheduled_ids.add(id(req))
                budget -= num_new
                i += 1
            # else: req was preempted and the list shifted, so i already points at the next one

        if out.num_preemptions == 0:
            now = time.monotonic()
            running_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
            held_back: list[Request] = []  # adapter sequences that wait for a slot, back into the queue below
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                lora = req.lora_request
                if lora is not None and (held_back or (lora.lora_int_id not in running_loras
                                                       and len(running_loras) >= self.max_loras)):  # fmt: skip
                    held_back.append(heapq.heappop(self.waiting))
                    continue
                first_time = req.num_computed_tokens == 0
                hits = self.kv.get_computed_blocks(req) if first_time else []
                num_cached = len(hits) * self.kv.block_size
                num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
                if not self.kv.allocate_slots(req, num_new, hits):
                    released = self._release_waiting_blocks(req)
                    if not released:
                        break
                    out.num_preemptions += released
                    continue  # again, with hits looked up anew (the released blocks stay cached)
                heapq.heappop(self.waiting)
                if first_time:
                    out.prefix_cache_queries += req.num_tokens
                    out.prefix_cache_hits += num_cached
                    req.num_computed_tokens = num_cached
                    if req.first_scheduled_time is None:
                        req.num_cached_tokens = num_cached
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    out.queue_times.append((req.request_id, max(0.0, now - req.arrival_time)))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append((req, num_new))
                budget -= num_new
                if lora is not None:
                    running_loras.add(lora.lora_int_id)
            for req in held_back:
                heapq.heappush(self.waiting, req)

        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        return out

    # ---- after the step -------------------------------------------------------------------------
    def update_from_output(
        self,
        out: SchedulerOutput,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        sampled: list[Request],
    ) -> list[EngineCoreOutput]:
        """Account for a step the model ran: computed tokens, full blocks cached, n > 1 choices forked once
        the prompt is in, each sampled token appended with its stop checks, finished sequences freed."""
        held = slots = 0
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
            held += req.num_computed_tokens
            slots += len(self.kv.block_ids(req))
            if req.fork_children and req.num_computed_tokens >= req.num_prompt_tokens:
                self._fork_children(req)
        outputs = [self._append_token(r, t, lp) for r, t, lp in zip(sampled, tokens, logprobs, strict=True)]
        c = self.counters
        c.num_steps += 1
        c.num_generated_tokens += len(sampled)
        # Occupancy and KV utilisation over the sequences that ran this step, measured before the
        # finished ones freed their blocks.
        c.sum_running_seqs += len(out.scheduled)
        c.sum_kv_utilization += held / (slots * self.kv.block_size) if slots else 0.0
        return outputs

    def make_stats(self, out: SchedulerOutput, num_compiling: int = 0) -> SchedulerStats:
        """This step's facts for the metrics; also folds its preemptions and prefix-cache lookups into the
        counters (a step may preempt or look up without running anything)."""
        c = self.counters
        c.num_preemptions += out.num_preemptions
        c.prefix_cache_queries += out.prefix_cache_queries
        c.prefix_cache_hit_tokens += out.prefix_cache_hits
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage,
            num_preemptions=out.num_preemptions,
            prefix_cache_queries=out.prefix_cache_queries,
            prefix_cache_hits=out.prefix_cache_hits,
            num_scheduled_tokens=out.num_scheduled_tokens,
            num_compiling=num_compiling,
            queue_times=out.queue_times,
            running_lora_adapters=_count_adapters(self.running) if self.max_loras else {},
            waiting_lora_adapters=_count_adapters(self.waiting) if self.max_loras else {},
        )

    def _fork_children(self, parent: Request) -> None:
        # Share the prompt's full blocks, leaving at least one token for each child to compute: it
        # needs its own logits to sample its first token.
        shared = (parent.num_prompt_tokens - 1) // self.kv.block_size
        for child in parent.fork_children:
            self.kv.fork(parent, child, shared)
            child.num_computed_tokens = shared * self.kv.block_size
            self.add_request_seq(child)
        parent.fork_children = []

    def _append_token(self, req: Request, token: int, lp: TokenLogprobs | None) -> EngineCoreOutput:
        req.token_ids.append(token)
        p = req.params
        reason: str | None = None
        stop_reason: int | str | None = None
        n_out = req.num_output_tokens
        if req.grammar is not None and accept_token(req, token):
            reason = "stop"  # the grammar accepted a stop token or can take nothing more
        elif n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                reason = "stop"
            elif token in p.stop_token_ids:
                reason, stop_reason = "stop", token
        if reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.running.remove(req)
            self.finish(req, reason, stop_reason)
        return EngineCoreOutput(
            request_id=req.request_id,
            index=req.index,
            new_token_ids=[token],
            new_logprobs=[lp] if lp is not None else None,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_cached_tokens=req.num_cached_tokens,
        )

    def _pick_victim(self, scheduled_ids: set[int]) -> Request:
        # Lowest priority (largest sort key), i.e. the most recently admitted under FCFS. Sequences
        # already scheduled in this step keep their slots unless nothing else is left.
        candidates = [r for r in self.running if id(r) not in scheduled_ids] or self.running
        return max(candidates, key=lambda r: r.sort_key)

    def _release_waiting_blocks(self, head: Request) -> int:
        """Free the blocks of waiting sequences other than head (forked choices); returns how many
        sequences gave theirs back. They recompute from the prefix cache once admitted."""
        released = 0
        for r in self.waiting:
            if r is not head and self.kv.block_ids(r):
                self.kv.free(r)
                r.num_computed_tokens = 0
                released += 1
        return released

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, req)


def _count_adapters(seqs: list[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in seqs:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts
