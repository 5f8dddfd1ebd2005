"""Paged KV cache bookkeeping: a preallocated block pool, per-sequence block tables, reference counts
and prefix caching over full blocks.

Only the scheduler calls this; the model runner receives block ids and slots, never the pool.
"""

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.kv_memory import blocks_for_tokens
from tokenmill.engine.request import Request


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] | None = None  # verified on every hit: a hash collision never changes output


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). OrderedDict gives O(1) removal from the
        # middle when a prefix-cache hit revives a freed block.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # chained hashes of the sequence's full computed blocks

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
    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached full blocks matching the start of the sequence.

        At least one token is always left to compute, because the step needs its logits.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        parent: int | None = None
        tokens = req.token_ids
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((parent, chunk))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Register the sequence's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        blocks = self.req_blocks.get(req.key)
        if not blocks:
            return
        hashes = self.req_hashes.setdefault(req.key, [])
        num_full = min(req.num_computed_tokens // bs, len(blocks))
        parent = hashes[-1] if hashes else None
        tokens = req.token_ids
        for i in range(len(hashes), num_full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((parent, chunk))
            hashes.append(h)
            parent = h
            block = self.blocks[blocks[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                block.token_ids = chunk
                self.cached[h] = block.block_id

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

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.key, [])
        self.req_hashes.pop(req.key, None)
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
            block.block_hash = None
            block.token_ids = None
        block.ref_cnt = 1
        return block_id
