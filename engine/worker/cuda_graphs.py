"""CUDA graph capture and replay of decode steps.

A decode step launches hundreds of small kernels; on a GPU the launch overhead rivals the work at small
batches. Each captured batch size replays the whole forward from static input buffers; a batch is padded
up to the nearest captured size (padding rows write nowhere: slot -1, and attend to one token), and
batches larger than the largest size run eagerly.

Under tensor parallel (pipeline parallel stays eager) every rank captures its own graphs, and the
row-parallel all-reduces (torch.distributed over NCCL) are captured into them: NCCL operations can be
captured from NCCL 2.9 on, and PyTorch's ProcessGroupNCCL supports capture once a warm-up collective
has created the communicator (its own tests capture `all_reduce` this way). Replays then line up
across ranks because every rank replays the same size for the same step (rank 0 broadcasts the step,
every rank pads it to the same captured size). Capture must stay collectively consistent, so
`capture_all` (a) checks that every rank has the same size list, (b) captures the sizes in the same
order everywhere and (c) after each size asks every rank, over the CPU (gloo) control group, whether it
succeeded, before any rank starts the next size's warm-up forward (whose all-reduces would otherwise
wait for a rank that gave up): one failure anywhere sends every rank back to eager decode.

Written without a GPU to test on (none was available in the sessions that wrote it, TP or not): capture
failures are caught and logged, and the engine then runs eagerly. tests/test_parallel.py proves the
agreement on CPU (gloo, a stand-in capture that fails on one rank); engine/bench/gpu_check_tp.py checks TP=2
graphs against eager tokens the day two GPUs are lent.
"""

import logging
from collections.abc import Callable

import torch
from tokenmill.engine.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def single_rank(ok: bool) -> bool:
    return ok


def capture_all(
    sizes: list[int],
    capture_one: Callable[[int], None],
    all_ok: Callable[[bool], bool] = single_rank,
    same_everywhere: Callable[[list[int]], bool] = lambda sizes: True,
) -> list[int]:
    """Capture each size, largest first; the sizes every rank captured, or [] (all ranks eager).

    all_ok(ok) returns True only when every rank passed True (a collective: every rank calls it once
    per size, in the same order); same_everywhere(sizes) only when every rank has the same list."""
    order = sorted(sizes, reverse=True)  # largest first, so smaller graphs reuse its memory pool
    if not same_everywhere(order):
        logger.warning("CUDA graph sizes differ between ranks (%s here); decode steps run eagerly", order)
        return []
    for bs in order:
        try:
            capture_one(bs)
            ok = True
        except Exception as e:  # capture is an optimisation: never let it stop the engine
            logger.warning("CUDA graph capture failed at batch size %d (%s: %s)", bs, type(e).__name__, e)
            ok = False
        if not all_ok(ok):  # every rank, before any starts the next size's warm-up collectives
            logger.warning("CUDA graph capture failed on %s at batch size %d; decode steps run eagerly",
                           "this rank" if not ok else "another rank", bs)  # fmt: skip
            return []
    return order


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
        self._pool = None  # the first (largest) graph's memory pool, shared by the smaller ones

    def capture(
        self,
        all_ok: Callable[[bool], bool] = single_rank,
        same_everywhere: Callable[[list[int]], bool] = lambda sizes: True,
    ) -> None:
        """Capture every size (under TP: with the other ranks, see capture_all)."""
        if capture_all(self.sizes, self._capture_one, all_ok, same_everywhere):
            torch.cuda.synchronize()
            logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
        else:
            self.graphs.clear()
            self._pool = None

    def _capture_one(self, bs: int) -> None:
        md = self._metadata(bs)
        args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, md)
        # Warm up eagerly: Triton compiles, and under TP the first all-reduce creates the NCCL
        # communicator, neither of which can happen inside a capture.
        self.model(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(*args)
        self._pool = graph.pool()
        self.graphs[bs] = (graph, out)

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
