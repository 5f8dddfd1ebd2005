"""One scheduling decision per step under a token budget and a sequence cap.

Running sequences first (a decode token each, or their next prefill chunk), then waiting ones.
Recompute preemption when blocks run out; nobody new is admitted in a step that preempted.

Only one kind of waiting sequence holds blocks: an n > 1 choice forked from its parent's prompt and not
yet run (engine_core.py's _fork_children). When the head of the queue cannot get its blocks, those are
taken back (recompute preemption while waiting), or the head could wait forever on sequences queued
behind it: the soak test's deadlock.
"""

import heapq
import time
from dataclasses import dataclass, field

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    # (sequence, number of tokens to compute this step), running sequences first
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    queue_times: list[tuple[str, float]] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = kv
        self.waiting: list[Request] = []  # a heap ordered by (priority, arrival, seq_no)
        self.running: list[Request] = []
        self.requests: dict[str, list[Request]] = {}  # request id -> its live sequences

    # ---- bookkeeping ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests.setdefault(req.request_id, []).append(req)
        heapq.heappush(self.waiting, req)

    def add_request_seq(self, req: Request) -> None:
        """Queue a sequence of an already-known request (a forked n > 1 choice)."""
        heapq.heappush(self.waiting, req)

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
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
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

        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        return out

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
