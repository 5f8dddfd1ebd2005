"""Paged KV cache bookkeeping: a preallocated block pool, per-sequence block tables, reference counts
and prefix caching over full blocks.

Only the scheduler calls this; the model runner receives block ids and slots, never the pool.

Prefix-cache keys are chained SHA-256 digests: block i's key hashes block i-1's key, block i's tokens and
its extra keys (the request's cache_salt, for the first block), so a key names the whole prefix up to
and including the block. A forgeable hash (Python's tuple hash) let a crafted prompt land on a block
computed after a different prefix (vLLM's CVE-2025-25183). On top of the digest, every hit is verified
against what the block recorded when it was cached (parent key, tokens, extra keys): a collision can
cost a hit, never change output.

KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, published by kv_events.py): with
`events` on, the manager records what it already decides (a run of blocks entering the cache, a block
leaving it, a reset) as one small tuple each; the publisher takes them once per step and does the
per-block work (hashes, tokens, extra keys) and the encoding on its own thread.
"""

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.kv_memory import blocks_for_tokens
from tokenmill.engine.request import Request

# The parent of a first block. Any fixed 32 bytes would do; SHA-256 of a label documents what it is.
ROOT_HASH = hashlib.sha256(b"tokenmill prefix cache root").digest()

# What a block's key covers beside its tokens and parent, as fixed slots (None: empty), or None when every
# slot is empty (the common case): (cache salt, LoRA adapter id).
ExtraKeys = tuple[str | None, int | None] | None
# (parent key, the block's tokens, extra keys): what a cached block holds, checked on every hit.
BlockIdentity = tuple[bytes, tuple[int, ...], ExtraKeys]

# KV-cache event records (kv_events.py turns them into vLLM's events):
#   (STORED, request, first block index, end block index): blocks [first, end) of request's chain entered
#       the cache, in order; their hashes are request.block_hashes[first:end] (which only ever grows)
#   (REMOVED, block hash): the block left the cache (evicted for reuse)
#   (CLEARED,): every block left the cache (reset_prefix_cache)
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


# Starts the LoRA field of a block's extra keys: no salt field can start so (its first 4 bytes are its
# length, and a 4 GiB salt is refused long before it reaches the hash).
_LORA_TAG = b"\xff\xff\xff\xff"


def extra_keys(req: Request, block_index: int) -> ExtraKeys:
    """The one place a block's extra keys are chosen: its hash covers them (encode_extra_keys) and its
    BlockStored event carries them (kv_events.py). Slots (cache salt, LoRA adapter id), in the first block
    only (later blocks inherit them through the chain). The adapter is keyed by its id, which is new for
    every load (lora_request.py): a prefix computed under one adapter is never served to another, nor to
    the base model, nor to a reload of the same name."""
    if block_index != 0 or (req.cache_salt is None and req.lora_request is None):
        return None
    return (req.cache_salt, None if req.lora_request is None else req.lora_request.lora_int_id)


def encode_extra_keys(keys: ExtraKeys) -> bytes:
    """The bytes a block's hash covers for its extra keys: the salt length-prefixed, so it cannot run into
    the token bytes; the adapter id after a tag no salt can start with."""
    if keys is None:
        return b""
    salt, lora_int_id = keys
    out = b""
    if salt is not None:
        raw = salt.encode("utf-8")
        out = len(raw).to_bytes(4, "little") + raw
    if lora_int_id is not None:
        out += _LORA_TAG + lora_int_id.to_bytes(8, "little")
    return out


_PACKERS: dict[int, struct.Struct] = {}  # block length -> compiled little-endian int64 packer


def hash_block_tokens(parent: bytes, token_ids: tuple[int, ...], extra: bytes = b"") -> bytes:
    """SHA-256 over the parent's key (32 bytes), the tokens (little-endian int64 each: every block of a pool
    has the same length, so the fields cannot shift into each other) and the extra keys."""
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
    return hashlib.sha256(parent + packer.pack(*token_ids) + extra).digest()


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and computed
    identity: BlockIdentity | None = None  # verified on every hit: a hash collision never changes output


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). OrderedDict gives O(1) removal from the
        # middle when a prefix-cache hit revives a freed block.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        # Per sequence: how many of its blocks have been registered in the cache (or found already there).
        self.req_num_cached: dict[str, int] = {}
        # KV-cache event records since the last take_events(); None: events off (nothing recorded).
        self.events: list[tuple] | None = [] if enable_kv_cache_events and enable_prefix_caching else None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, req: Request) -> list[int]:
        return self.req_blocks.get(req.key, [])

    # ---- prefix caching ------------------------------------------------------------------------
    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The chained keys of req's first num_blocks full blocks, computed once each and kept on the
        request (its tokens are only ever appended, so they stay valid across preemption)."""
        hashes = req.block_hashes
        bs = self.block_size
        tokens = req.token_ids
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_blocks):
            extra = encode_extra_keys(extra_keys(req, i))
            parent = hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs]), extra)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached full blocks matching the start of the sequence.

        At least one token is always left to compute, because the step needs its logits.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hashes = self.block_hashes(req, max_blocks)
        hits: list[int] = []
        parent = ROOT_HASH
        tokens = req.token_ids
        for i in range(max_blocks):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            identity = (parent, tuple(tokens[i * bs : (i + 1) * bs]), extra_keys(req, i))
            if self.blocks[block_id].identity != identity:
                break
            hits.append(block_id)
            parent = hashes[i]
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Register the sequence's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.key)
        if not blocks:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(blocks))
        start = self.req_num_cached.get(req.key, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(req, num_full)
        tokens = req.token_ids
        events = self.events
        run_start = start  # the run of blocks this call caches, for its event
        for i in range(start, num_full):
            h = hashes[i]
            block = self.blocks[blocks[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                parent = hashes[i - 1] if i else ROOT_HASH
                block.identity = (parent, tuple(tokens[i * bs : (i + 1) * bs]), extra_keys(req, i))
                self.cached[h] = block.block_id
            elif events is not None:  # already cached (a hit, a shared prefix): not stored again
                if run_start < i:
                    events.append((STORED, req, run_start, i))
                run_start = i + 1
        if events is not None and run_start < num_full:
            events.append((STORED, req, run_start, num_full))
        self.req_num_cached[req.key] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache: only while no sequence holds a block
        (a running sequence's blocks stay valid for it, and keys chained onto forgotten ones would name
        parents a subscriber no longer has). Returns whether the cache was reset."""
        if self.num_used_blocks:
            return False
        for block_id in self.cached.values():
            block = self.blocks[block_id]
            block.block_hash = None
            block.identity = None
        self.cached.clear()
        if self.events is not None:
            self.events.append((CLEARED,))
        return True

    def take_events(self) -> list[tuple]:
        """The event records since the last call (once per step); empty when events are off."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for num_new_tokens more tokens after req.num_computed_tokens.

        computed_blocks (prefix-cache hits) are taken on the first admission. Returns False, changing
        nothing, when the pool cannot supply the blocks.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(req.key, [])
        have = len(blocks) + len(computed_blocks)
        # Hits are not yet counted in num_computed_tokens (the caller adds them after admission).
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = blocks_for_tokens(total, self.block_size) - have
        # Hits on freed blocks take those blocks out of the free queue too.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if max(need, 0) + revived > len(self.free_queue):
            return False
        blocks = self.req_blocks.setdefault(req.key, blocks)
        for b in computed_blocks:
            self._touch(b)
            blocks.append(b)
        for _ in range(max(need, 0)):
            blocks.append(self._pop_free())
        return True

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Share the parent's first num_blocks blocks with the child (n > 1 prompts)."""
        shared = self.req_blocks[parent.key][:num_blocks]
        for b in shared:
            self._touch(b)
        self.req_blocks[child.key] = list(shared)
        if not child.block_hashes:  # same prompt, same keys: no need to hash it again
            child.block_hashes = parent.block_hashes[:num_blocks]

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.key, [])
        self.req_num_cached.pop(req.key, None)
        # Tail first: the tail blocks of a freed sequence are the least likely to be shared, so they are
        # evicted first; blocks without a hash hold nothing reusable and go to the very front.
        for b in reversed(blocks):
            block = self.blocks[b]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[b] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(b, last=False)

    # ---- internals -----------------------------------------------------------------------------
    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evict from the prefix cache: its contents are about to be overwritten.
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.append((REMOVED, block.block_hash))
            block.block_hash = None
            block.identity = None
        block.ref_cnt = 1
        return block_id
