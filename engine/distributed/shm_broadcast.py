"""A shared-memory ring that carries each step from rank 0 to the other ranks of its node.

The idea is vLLM's (a shared-memory broadcast queue for the ranks of one node), the layout our own.
One writer (rank 0), R readers (its node's other ranks), C chunks. A file in /dev/shm mapped by every
process holds, per chunk, one int64 sequence number the writer sets and one int64 acknowledgement per
reader; then, per chunk, an int64 length and the payload.

- Write message n (1, 2, ...): chunk n % C. Wait until every reader acknowledged the message that
  chunk held before (its sequence number), copy the payload in, then publish: seq = n.
- Reader r, expecting message n: wait until the chunk's seq == n, copy the payload out, ack = n.

Each of these int64 stores is aligned, hence atomic; a memory fence (a lock's acquire and release,
as vLLM does) between the payload and the flag keeps a reader from seeing the flag before the data on
weakly ordered CPUs. No socket on the hot path: a waiting reader polls, yielding its core, for
SPIN_S, then sleeps in steps growing to MAX_SLEEP_S (so an idle engine costs about nothing and the
first step after an idle spell waits at most MAX_SLEEP_S more). Ranks on other nodes cannot map this
file: step_input.py sends them the step over gloo.
"""

import mmap
import os
import tempfile
import threading
import time
import uuid

import numpy as np

SPIN_S = 0.05  # a reader yields-and-polls this long after a message before it starts sleeping
MAX_SLEEP_S = 0.001
NUM_CHUNKS = 2  # rank 0 never runs more than one step ahead: the next forward waits on a collective
_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full barrier: acquiring and releasing a lock is an atomic read-modify-write in CPython's
    pthread locks, which orders the loads and stores around it."""
    _fence_lock.acquire()
    _fence_lock.release()


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmRing:
    """One side of the ring: the writer (reader_index None) or reader reader_index (0-based)."""

    def __init__(
        self, path: str, num_readers: int, chunk_bytes: int, reader_index: int | None, create: bool
    ) -> None:
        self.path = path
        self.num_readers = num_readers
        self.chunk_bytes = chunk_bytes
        self.reader_index = reader_index
        flags = NUM_CHUNKS * (1 + num_readers)
        size = 8 * flags + NUM_CHUNKS * (8 + chunk_bytes)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # [chunk, 0]: sequence number; [chunk, 1 + r]: reader r's acknowledgement.
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=flags).reshape(
            NUM_CHUNKS, 1 + num_readers
        )
        self._lens = [
            np.frombuffer(self._map, dtype=np.int64, count=1, offset=8 * flags + c * (8 + chunk_bytes))
            for c in range(NUM_CHUNKS)
        ]
        self._data = [
            np.frombuffer(
                self._map, dtype=np.uint8, count=chunk_bytes, offset=8 * flags + c * (8 + chunk_bytes) + 8
            )
            for c in range(NUM_CHUNKS)
        ]
        self._views = [memoryview(d) for d in self._data]  # the writer's copy target
        self._n = 0  # the last message written (writer) or read (reader)

    @classmethod
    def create(cls, num_readers: int, chunk_bytes: int) -> "ShmRing":
        path = os.path.join(shm_dir(), f"tokenmill-step-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return cls(path, num_readers, chunk_bytes, None, create=True)

    @classmethod
    def attach(cls, path: str, num_readers: int, chunk_bytes: int, reader_index: int | None) -> "ShmRing":
        """Map a ring another process created, as reader reader_index (None: as its writer)."""
        return cls(path, num_readers, chunk_bytes, reader_index, create=False)

    def unlink(self) -> None:
        """Remove the file once every reader mapped it: the mappings live on, nothing is left behind
        when the processes end, however they end."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def write(self, payload: np.ndarray, timeout_s: float) -> None:
        """Publish payload (any contiguous array) to every reader; raises TimeoutError naming the
        readers that have not taken the chunk's previous message within timeout_s."""
        # Plain lists and memoryviews, not numpy ops, on this path: a numpy compare or slice assignment
        # costs microseconds each, the whole write about 4 us this way (docs/engine.md).
        raw = memoryview(np.ascontiguousarray(payload)).cast("B")
        size = raw.nbytes
        if size > self.chunk_bytes:
            raise ValueError(f"a step of {size} bytes does not fit the {self.chunk_bytes}-byte ring chunk")
        n = self._n + 1
        c = n % NUM_CHUNKS
        row = self._flags[c]
        deadline = None
        while True:
            flags = row.tolist()  # [seq, ack of reader 0, ...]: every reader took the chunk's last message
            if flags.count(flags[0]) == len(flags):
                break
            deadline = deadline or time.monotonic() + timeout_s
            if time.monotonic() > deadline:
                late = [r + 1 for r, ack in enumerate(flags[1:]) if ack != flags[0]]  # reader r is rank r + 1
                raise TimeoutError(
                    f"parallel ranks {late} did not take step message {flags[0]} within {timeout_s:.0f} s"
                )
            os.sched_yield()
        memory_fence()  # the readers' acks are seen before the chunk is overwritten
        self._views[c][:size] = raw
        self._lens[c][0] = size
        memory_fence()  # the payload is visible before the sequence number
        row[0] = n
        self._n = n

    def read(self) -> np.ndarray:
        """Block until the next message; returns a copy of its bytes. (A reader whose writer died is
        ended by parallel_worker.exit_with_parent, not here.)"""
        n = self._n + 1
        c = n % NUM_CHUNKS
        row = self._flags[c]
        start = time.monotonic()
        sleep_s = 0.0
        while row[0] != n:
            if time.monotonic() - start < SPIN_S:
                os.sched_yield()
                continue
            sleep_s = min(MAX_SLEEP_S, (sleep_s * 2) or 1e-5)
            time.sleep(sleep_s)
        memory_fence()  # the sequence number is seen before the payload is read
        out = self._data[c][: int(self._lens[c][0])].copy()
        memory_fence()
        row[1 + self.reader_index] = n
        self._n = n
        return out

    def close(self) -> None:
        self._flags = self._lens = self._data = self._views = None
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass
