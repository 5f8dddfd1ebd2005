"""CUDA graph capture and replay of decode steps.

A decode step launches hundreds of small kernels; on a GPU the launch overhead rivals the work at small
batches. Each captured batch size replays the whole forward from static input buffers; a batch is padded
up to the nearest captured size (padding rows write nowhere: slot -1, and attend to one token), and
batches larger than the largest size run eagerly.

Written without a GPU to test on (none was available in the session that wrote it): capture failures are
caught and logged, and the engine then runs eagerly.
"""

import logging

import torch
from tokenmill.engine.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CUDAGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(b for b in batch_sizes if b <= max_num_seqs)
        n = self.sizes[-1] if self.sizes else 0
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.max_seq_len = max_model_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        pool = None
        try:
            for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
                md = self._metadata(bs)
                args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, md)
                self.model(*args)  # warm up: Triton compiles outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                pool = graph.pool()
                self.graphs[bs] = (graph, out)
            torch.cuda.synchronize()
            logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
        except Exception as e:  # capture is an optimisation: never let it stop the engine
            logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)
            self.graphs.clear()

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            decode_only=True,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.sizes[-1]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(b for b in self.sizes if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:bs].fill_(1)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
