"""What KV-cache events cost the engine's step: the same decode workload on two engines in one process,
--kv-events-config off and on, stepped alternately (off, on, off, on, ...) so that the shared machine's
load falls on both alike, a subscriber in another process receiving every batch (as a router would).

    python -m tokenmill.engine.bench.kv_events [--batch 64] [--prompt-len 64] [--max-tokens 64] [--rounds 2]
        [--scheduler-rounds 20] [--model M] [--dtype auto] [--skip-model]

Two measurements, each a ratio on / off:
- scheduler only (no model): Scheduler + KVCacheManager steps fed made-up tokens, the engine-side
  bookkeeping events add to (records in the step, the batch handed to the publisher thread), at a scale
  where nothing hides it;
- engine step: EngineCore.step() with the model (the bundled one unless --model), what a request sees.
Each prints the median step time of the steps that ran the whole batch, off and on, the median of the
paired steps' ratios (step i on / step i off: the same work, moments apart) and the events and bytes
the subscriber received per step.
"""

import argparse
import random
import statistics
import subprocess
import sys
import time

from tokenmill.engine.config import EngineConfig, KVEventsConfig
from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.kv_events import ZmqEventPublisher
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams

# The subscriber: another process, msgpack-decoding every batch; prints what it got when told to stop.
SUBSCRIBER = """
import sys, msgpack, zmq
ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(sys.argv[1])
ctrl = ctx.socket(zmq.PAIR); ctrl.bind(sys.argv[2])
poller = zmq.Poller(); poller.register(sub, zmq.POLLIN); poller.register(ctrl, zmq.POLLIN)
batches = events = nbytes = 0
while True:
    ready = dict(poller.poll())
    if sub in ready:
        _, _, payload = sub.recv_multipart()
        batches += 1; nbytes += len(payload); events += len(msgpack.unpackb(payload)[1])
    if ctrl in ready:
        cmd = ctrl.recv()
        if cmd == b"stop":
            ctrl.send_string(f"{batches} {events} {nbytes}"); break
        ctrl.send_string(f"{batches} {events} {nbytes}")
"""


def _max_len(args: argparse.Namespace) -> int:
    return 3 * args.prompt_len // 2 + args.max_tokens + 16


class Subscriber:
    def __init__(self, endpoint: str, control: str) -> None:
        import zmq

        self.proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint, control])
        self.ctx = zmq.Context()
        self.ctrl = self.ctx.socket(zmq.PAIR)
        self.ctrl.connect(control)

    def wait_connected(self, publisher: ZmqEventPublisher, timeout_s: float = 60.0) -> None:
        """Publish empty batches until one arrives: PUB/SUB drops what is sent before the subscription
        has reached the publisher."""
        deadline = time.monotonic() + timeout_s
        while self.counts()[0] == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the subscriber process received nothing")
            publisher.publish([])
            time.sleep(0.05)

    def counts(self, cmd: bytes = b"count") -> tuple[int, int, int]:
        self.ctrl.send(cmd)
        batches, events, nbytes = map(int, self.ctrl.recv_string().split())
        return batches, events, nbytes

    def stop(self) -> None:
        self.counts(b"stop")
        self.proc.wait(10)
        self.ctrl.close(linger=0)
        self.ctx.term()


def _prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Lengths spread over [prompt_len / 2, 3 prompt_len / 2], so that sequences fill their blocks on
    different steps (equal lengths would fill all at once, every 16th step); a new seed every round, so
    there are no prefix-cache hits and every block is stored."""
    rng = random.Random(seed)
    lengths = [rng.randint(prompt_len // 2, 3 * prompt_len // 2) for _ in range(batch)]
    return [[rng.randrange(1, 49000) for _ in range(n)] for n in lengths]


class SchedulerOnly:
    """Scheduler + KVCacheManager steps fed made-up tokens: the engine-side bookkeeping without a model."""

    def __init__(self, events: ZmqEventPublisher | None, args: argparse.Namespace, seed: int) -> None:
        config = EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=2 * args.batch * args.prompt_len)
        self.kv = KVCacheManager(args.batch * (_max_len(args) // 16 + 2), 16, True, enable_kv_cache_events=events is not None)
        self.sched = Scheduler(config, self.kv, _max_len(args))
        self.events = events
        self.batch = args.batch
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for i, p in enumerate(_prompts(args.batch, args.prompt_len, seed)):
            self.sched.add_request(Request(f"r{i}", 0, p, len(p), params, arrival_time=0.0))
        self.rng = random.Random(seed)

    def has_work(self) -> bool:
        return self.sched.has_unfinished()

    def step(self) -> tuple[float, bool]:
        t0 = time.perf_counter()
        out = self.sched.schedule()
        sampled = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
        self.sched.update_from_output(out, [self.rng.randrange(49000) for _ in sampled], [None] * len(sampled), sampled)
        if self.events is not None:  # what EngineCore.step does after the update
            records = self.kv.take_events()
            if records:
                self.events.publish(records)
        elapsed = time.perf_counter() - t0
        return elapsed, len(out.scheduled) == self.batch and out.num_scheduled_tokens == self.batch


class EngineSteps:
    """EngineCore.step() over one batch of requests."""

    def __init__(self, core, args: argparse.Namespace, seed: int) -> None:
        self.core, self.batch = core, args.batch
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for i, p in enumerate(_prompts(args.batch, args.prompt_len, seed)):
            core.add_request(EngineCoreRequest(f"s{seed}-{i}", p, params, arrival_time=time.monotonic()))

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> tuple[float, bool]:
        t0 = time.perf_counter()
        _, stats = self.core.step()
        elapsed = time.perf_counter() - t0
        return elapsed, stats.num_running == self.batch and stats.num_scheduled_tokens == self.batch


def paired_steps(off_side, on_side) -> tuple[list[float], list[float]]:
    """Step the two alternately (off, on, off, on, ...) so that whatever else loads the machine falls on
    both alike; the full-batch steps' times of each, in step order (the same workload: pairs match)."""
    off: list[float] = []
    on: list[float] = []
    while off_side.has_work() or on_side.has_work():
        for side, out in ((off_side, off), (on_side, on)):
            if side.has_work():
                elapsed, full = side.step()
                if full:
                    out.append(elapsed)
    return off, on


def _report(name: str, off: list[float], on: list[float], sub: Subscriber, before: tuple[int, int, int]) -> None:
    batches, events, nbytes = (a - b for a, b in zip(sub.counts(), before, strict=True))
    m_off, m_on = statistics.median(off), statistics.median(on)
    paired = statistics.median(b / a for a, b in zip(off, on, strict=False))
    print(f"{name}: median step {m_off * 1e3:.3f} ms off, {m_on * 1e3:.3f} ms on (x{m_on / m_off:.3f}); median "
          f"of the paired steps' ratios x{paired:.3f} over {min(len(off), len(on))} full-batch steps; the "
          f"subscriber got {batches} batches, {events} events, {nbytes / 1e3:.0f} kB ({events / max(len(on), 1):.1f} "
          f"events and {nbytes / max(len(on), 1):.0f} B per full-batch step, all steps' batches counted)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tokenmill.engine.bench.kv_events")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs of engine rounds, interleaved")
    ap.add_argument("--scheduler-rounds", type=int, default=20, help="off/on pairs of scheduler-only rounds")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-model", action="store_true", help="the scheduler-only measurement alone")
    args = ap.parse_args(argv)

    import tempfile

    folder = tempfile.mkdtemp(prefix="kv-events-bench-")
    endpoint, control = f"ipc://{folder}/events", f"ipc://{folder}/control"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    sub = Subscriber(endpoint, control)
    publisher = ZmqEventPublisher(config, 16)
    sub.wait_connected(publisher)
    before = sub.counts()
    off: list[float] = []
    on: list[float] = []
    for r in range(args.scheduler_rounds):
        o, n = paired_steps(SchedulerOnly(None, args, seed=r), SchedulerOnly(publisher, args, seed=r))
        off, on = off + o, on + n
    publisher.flush()
    time.sleep(0.2)
    _report(f"scheduler only, batch {args.batch}", off, on, sub, before)
    publisher.shutdown()

    if not args.skip_model:
        from tokenmill.engine.core.engine_core import EngineCore

        common = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.batch,
                      max_model_len=_max_len(args))  # fmt: skip
        core_off = EngineCore(EngineConfig(**common))
        core_on = EngineCore(EngineConfig(**common, kv_events_config={
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}))  # fmt: skip
        sub.wait_connected(core_on.kv_events)
        warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
        paired_steps(EngineSteps(core_off, warm, seed=1000), EngineSteps(core_on, warm, seed=1000))  # not counted
        before = sub.counts()
        off, on = [], []
        for r in range(args.rounds):
            o, n = paired_steps(EngineSteps(core_off, args, seed=2000 + r), EngineSteps(core_on, args, seed=2000 + r))
            off, on = off + o, on + n
        core_on.kv_events.flush()
        time.sleep(0.2)
        print(f"model: {core_on.model_path} ({core_on.plan.dtype}, {core_on.executor.device})")
        _report(f"engine step, batch {args.batch}", off, on, sub, before)
        core_on.shutdown()
    sub.stop()


if __name__ == "__main__":
    main()
