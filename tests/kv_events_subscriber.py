"""A KV-cache event subscriber written from vLLM's wire format alone (ZeroMQ + msgpack, no engine import),
as an external router would write one: it rebuilds the set of blocks a pod holds from the events.

Messages are [topic, seq (8 bytes big-endian), payload]; a payload is [ts, events, data_parallel_rank];
events are arrays tagged by their first element (docs/serving.md, "KV-cache events"). A gap in the
sequence numbers (a batch sent before this socket was connected, or dropped) is filled from the replay
socket before anything newer is applied, so the rebuilt set never skips a batch.
"""

import collections
import time

import msgpack
import zmq

HASH_BYTES = 32  # the engine's block keys are SHA-256 digests
END_SEQ = -1


class KVEventState:
    """The blocks a pod holds, as its event batches say: apply() each payload in sequence order."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.counts: collections.Counter[str] = collections.Counter()
        self.stored: list[list] = []  # every BlockStored, as received
        self.orphan_parents = 0  # BlockStored whose parent this pod no longer holds
        self.payloads: list[bytes] = []

    def apply(self, payload: bytes) -> None:
        self.payloads.append(payload)
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and abs(ts - time.time()) < 3600, ts
        assert dp_rank == 0
        for event in events:
            tag = event[0]
            self.counts[tag] += 1
            if tag == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys = event[1:]
                check_hashes(hashes)
                assert parent is None or (isinstance(parent, bytes) and len(parent) == HASH_BYTES)
                if parent is not None and parent not in self.blocks:
                    # The engine keeps one block per key: a sequence that computed a block another had
                    # cached first continues a chain whose parent may since have been evicted.
                    self.orphan_parents += 1
                assert len(tokens) == len(hashes) * block_size and all(isinstance(t, int) for t in tokens)
                assert medium == "GPU" and (lora_id is None) == (lora_name is None)
                assert lora_id is None or (isinstance(lora_id, int) and isinstance(lora_name, str))
                assert isinstance(extra_keys, list) and len(extra_keys) == len(hashes)
                self.blocks.update(hashes)
                self.stored.append(event)
            elif tag == "BlockRemoved":
                hashes, medium = event[1:]
                check_hashes(hashes)
                assert medium == "GPU"
                missing = [h for h in hashes if h not in self.blocks]
                assert not missing, f"removal of {len(missing)} blocks never stored"
                self.blocks.difference_update(hashes)
            elif tag == "AllBlocksCleared":
                assert len(event) == 1
                self.blocks.clear()
            else:
                raise AssertionError(f"unknown event {tag!r}")


class KVEventSubscriber(KVEventState):
    def __init__(self, endpoint: str, *, bind: bool, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        super().__init__()
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        if bind:  # llm-d's indexer binds and the engines connect to it
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.endpoint = self.sub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = replay_endpoint
        self.next_seq = 0
        self.topics: set[bytes] = set()
        self.replayed = 0  # batches that came from the replay socket

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()

    # ---- receiving ------------------------------------------------------------------------------
    def drain_until(self, seq_count: int, timeout_s: float = 10.0) -> None:
        """Apply batches until every one below seq_count is in (replaying gaps)."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq < seq_count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only batches below {self.next_seq} of {seq_count} arrived in {timeout_s}s")
            if self.sub.poll(100):
                topic, seq_bytes, payload = self.sub.recv_multipart()
                self.topics.add(topic)
                self._receive(int.from_bytes(seq_bytes, "big"), payload)
            elif self.replay_endpoint is not None and seq_count > self.next_seq:
                self._replay()  # the newest batches may have gone out before the subscription took

    def _receive(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied (from a replay)
        if seq > self.next_seq:
            assert self.replay_endpoint is not None, f"batches {self.next_seq}..{seq - 1} were missed"
            self._replay()
            if seq < self.next_seq:
                return
        assert seq == self.next_seq, (seq, self.next_seq)
        self.apply(payload)
        self.next_seq += 1

    def _replay(self) -> None:
        """Ask the replay socket (vLLM's ROUTER) for every batch from next_seq on."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while True:
                assert req.poll(5000), "the replay socket did not answer"
                _, seq_bytes, payload = req.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq == self.next_seq:
                    self.apply(payload)
                    self.next_seq += 1
                    self.replayed += 1
        finally:
            req.close(linger=0)


def check_hashes(hashes: list) -> None:
    assert isinstance(hashes, list) and hashes
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes), hashes[:2]
