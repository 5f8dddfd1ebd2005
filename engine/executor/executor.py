"""Executor: the engine core's one handle on the ranks that run the model.

Rank 0's Worker runs in the core's process; with tensor x pipeline parallelism > 1 the other ranks are
started first (multiproc.py: this node's rank processes; other nodes' come from `serve --headless`), load
their shards alongside rank 0's, and follow every step rank 0 broadcasts. The ranks agree on one pool
size, and a step that fails names the rank that took it down.
"""

from collections.abc import Callable

import torch
from tokenmill.engine.distributed.parallel_state import SINGLE
from tokenmill.engine.executor.multiproc import LeaderGroup, start_leader
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.request import Request
from tokenmill.engine.worker.engine_plan import EnginePlan
from tokenmill.engine.worker.step_input import max_packed_len
from tokenmill.engine.worker.worker import Worker


def _no_mark(name: str) -> None:
    return None


class Executor:
    def __init__(self, plan: EnginePlan, mark: Callable[[str], None] = _no_mark) -> None:
        """Start the ranks, build rank 0's Worker and load its weights. mark(phase): the start-up timer."""
        self.plan = plan
        config = plan.config
        device = torch.device(plan.device)
        self.group: LeaderGroup | None = None
        par = SINGLE
        if plan.world_size > 1:  # the other ranks start now and load their shards alongside this one
            if device.type == "cuda":
                device = torch.device("cuda:0")
                torch.cuda.set_device(device)
            step_bytes = 8 * max_packed_len(
                config.max_num_seqs, config.max_num_batched_tokens, plan.max_model_len, config.block_size,
                config.max_loras if config.enable_lora else 0,
            )  # fmt: skip
            self.group = start_leader(config, device, step_bytes)
            par = self.group.par
            mark("ranks")
        self.device = device
        self.worker = Worker(plan, device, par)
        self.worker.load_model(mark)

    def determine_num_kv_blocks(self) -> int:
        """The blocks every rank's pool holds: the smallest any rank fits."""
        return self.worker.determine_num_kv_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def add_lora(self, lora: LoRARequest) -> None:
        """Rank 0 reads the adapter now; the other ranks read their shards when a step first names it."""
        self.worker.add_lora(lora)

    def execute_model(
        self, scheduled: list[tuple[Request, int]], block_ids: list[list[int]]
    ) -> tuple[list[int], list[TokenLogprobs | None], list[Request]]:
        try:
            return self.worker.execute_model(scheduled, block_ids)
        except Exception as e:
            if self.group is not None:  # name the rank that took the step down
                self.group.step_failed(e, self.plan.config.collective_timeout_s)
            raise

    def shutdown(self) -> None:
        """Stop the other ranks (nothing to do on one rank); also runs at interpreter exit."""
        if self.group is not None:
            self.group.shutdown()
