"""vLLM's KV-cache events, published from the engine core over ZeroMQ, so that a KV-aware router (llm-d's
precise prefix-cache scorer and its kv-cache indexer) can track which blocks each pod holds.

The wire format is vLLM's (vllm/distributed/kv_events.py: msgspec structs with array_like, omit_defaults
and tag), in msgpack:

  message           multipart [topic, sequence number (8 bytes, big-endian, from 0), payload]
  payload           [ts (float, seconds since the epoch), [event, ...], data_parallel_rank (0)]
  BlockStored       ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                     medium, lora_name, extra_keys]
  BlockRemoved      ["BlockRemoved", block_hashes, medium]
  AllBlocksCleared  ["AllBlocksCleared"]

Block hashes are the prefix cache's own keys (kv_cache_manager.py: 32-byte chained SHA-256 digests, sent
as msgpack bin, as vLLM sends its sha256 keys); parent_block_hash is None for a chain's first block;
medium is "GPU" (vLLM's name for the engine's own KV pool, whatever the device); extra_keys holds, per
block, the tuple of keys beside the tokens that its hash covers (on a chain's first block: the LoRA
adapter's id, then the cache salt) or None; lora_id / lora_name name the request's adapter (None for
the base model). vLLM's group_idx (hybrid models' KV groups) is left out, as omit_defaults leaves it
out of a vLLM event without one: the engine has one KV group.

Replay (vLLM's): a ROUTER socket at replay_endpoint; a client sends [b"", first sequence number wanted
(8 bytes, big-endian)] and gets [b"", seq, payload] for every batch still buffered from there, then
[b"", -1 (8 bytes, signed), b""].

The engine's step only appends a small record per run of blocks cached or per block evicted
(kv_cache_manager.py) and hands the step's records to publish() (a queue put); building the events,
encoding and sending happen on the publisher thread.
"""

import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import msgpack
from tokenmill.engine.config import KVEventsConfig
from tokenmill.engine.core.kv_cache_manager import CLEARED, REMOVED, STORED, extra_keys
from tokenmill.engine.request import Request

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's medium for blocks in the engine's KV pool
DATA_PARALLEL_RANK = 0  # one engine core per replica: no data-parallel ranks
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay
SHUTDOWN_TIMEOUT_S = 1.0  # how long shutdown waits for queued batches to go out


def event_extra_keys(req: Request, block_index: int) -> tuple[int | str, ...] | None:
    """A block's extra keys as its BlockStored carries them: what its hash covers beside the tokens
    (kv_cache_manager.extra_keys), in vLLM's order (adapter, then cache salt); None when nothing."""
    keys = extra_keys(req, block_index)
    if keys is None:
        return None
    salt, lora_int_id = keys
    return tuple(k for k in (lora_int_id, salt) if k is not None)


def build_events(records: list[tuple], block_size: int) -> list[list]:
    """vLLM's events (as msgpack arrays) from one step's records, in order. Removals in a row become one
    BlockRemoved. A STORED record names a request and a range of its blocks: the request's hashes and
    tokens in that range never change (both lists are only appended to), so they are read here, on the
    publisher thread, while the engine goes on."""
    events: list[list] = []
    removed: list[bytes] | None = None
    for record in records:
        kind = record[0]
        if kind == REMOVED:
            if removed is None:
                removed = []
                events.append(["BlockRemoved", removed, MEDIUM_GPU])
            removed.append(record[1])
            continue
        removed = None
        if kind == STORED:
            _, req, first, end = record
            hashes = req.block_hashes[first:end]
            parent = req.block_hashes[first - 1] if first else None
            tokens = req.token_ids[first * block_size : end * block_size]
            keys = [event_extra_keys(req, i) for i in range(first, end)]
            lora = req.lora_request
            lora_id, lora_name = (None, None) if lora is None else (lora.lora_int_id, lora.lora_name)
            events.append(["BlockStored", hashes, parent, tokens, block_size, lora_id, MEDIUM_GPU, lora_name, keys])
        elif kind == CLEARED:
            events.append(["AllBlocksCleared"])
        else:
            raise ValueError(f"unknown KV event record {kind!r}")
    return events


def encode_batch(ts: float, events: list[list]) -> bytes:
    return msgpack.packb([ts, events, DATA_PARALLEL_RANK], use_bin_type=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local endpoint, connect to a named host (whose subscriber binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """A PUB socket (and an optional ROUTER for replays) fed by a thread from a queue of step records.

    The sockets are made (and bound) here, so that a taken port fails start-up with its reason, and are
    used only by the thread from then on (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        import zmq

        self.block_size = block_size
        self.topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[float, list[tuple]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self.num_published = 0  # batches sent; the next one's sequence number
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"--kv-events-config: cannot open endpoint {config.endpoint!r} / replay_endpoint "
                f"{config.replay_endpoint!r}: {e}"
            ) from None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info(
            "KV-cache events: publishing on %s (%s)%s, topic %r",
            config.endpoint,
            "bound" if binds(config.endpoint) else "connected",
            f", replay on {config.replay_endpoint}" if config.replay_endpoint else "",
            config.topic,
        )

    def publish(self, records: list[tuple]) -> None:
        """One step's records (the engine's thread). Blocks only when max_queue_size batches are already
        waiting, as vLLM's does: a late event is better than a lost one."""
        self._queue.put((time.time(), records))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch handed to publish() has gone out; False if that takes over timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT_S), then close the sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV-cache events: %d batches were still queued at shutdown", self._queue.qsize())
            return  # the daemon thread still owns the sockets; process exit closes them
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ---- the publisher thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV-cache events: a replay request failed")
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            ts, records = item
            try:
                seq = next(self._seq)
                payload = encode_batch(ts, build_events(records, self.block_size))
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_published = seq + 1
            except Exception:
                # One bad batch must not stop the stream; its missing sequence number shows the gap.
                logger.exception("KV-cache events: publishing a batch failed")
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-cache events: a replay request has %d frames, expected 3", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None, block_size: int) -> ZmqEventPublisher | None:
    return None if config is None else ZmqEventPublisher(config, block_size)
