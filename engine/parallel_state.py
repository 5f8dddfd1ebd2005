"""Which rank this process is, its groups, and the few collectives the model calls.

Layout (as in vLLM): global rank = pp_rank * T + tp_rank. Ranks of one pipeline stage form a tensor
parallel group; rank 0 (stage 0, tp 0) runs the scheduler and the sampler. One world group carries
the model's collectives with a short timeout (a hung rank fails the step); a second, gloo "control"
group carries the per-step broadcast, whose waits are unbounded (an idle engine sends nothing).
"""

import datetime
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tokenmill.engine import kv_memory
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.model_config import ModelConfig

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # idle workers wait for the next step this long
RENDEZVOUS_TIMEOUT_S = 600.0  # multi-node workers may start minutes after the leader


@dataclass(slots=True)
class ParallelState:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    tp_group: object | None = None  # None: single rank, no collectives
    control_group: object | None = None
    world_group: object | None = None  # pipeline sends and receives, with the collective timeout
    tp_ranks: list[list[int]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank holding this rank's tensor shard on pipeline stage pp_rank."""
        return pp_rank * self.tp_size + self.tp_rank


SINGLE = ParallelState()


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Contiguous layers of stage pp_rank; the first num_layers % pp_size stages take one more."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    """KV heads of one rank: an even split, or (fewer KV heads than ranks) one head shared by
    tp_size / num_kv_heads consecutive ranks, matching the query heads those ranks hold."""
    per_rank = kv_memory.kv_heads_per_rank(num_kv_heads, tp_size)
    if num_kv_heads >= tp_size:
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    first = tp_rank * num_kv_heads // tp_size
    return range(first, first + 1)


def vocab_shard(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first row, rows) of this rank's embedding / LM-head shard; every rank holds the same padded
    number of rows, the last one's tail is zero and its logits are dropped."""
    per_rank = math.ceil(vocab_size / tp_size)
    return tp_rank * per_rank, per_rank


def validate_parallel(config: EngineConfig, mc: ModelConfig, device_type: str) -> None:
    """Refuse a TP x PP split this model or machine cannot run, before any weight is read."""
    t, p = config.tensor_parallel_size, config.pipeline_parallel_size
    if t < 1 or p < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be at least 1; got {t} and {p}")
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    if heads % t:
        raise ValueError(
            f"tensor_parallel_size={t} does not divide the model's {heads} attention heads; "
            f"use one of {[d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]}"
        )
    if kv % t and t % kv:
        raise ValueError(
            f"tensor_parallel_size={t} neither divides the model's {kv} KV heads nor is a multiple of them "
            "(KV heads are split evenly or replicated)"
        )
    if mc.intermediate_size % t:
        raise ValueError(
            f"tensor_parallel_size={t} does not divide the model's MLP width {mc.intermediate_size}"
        )
    if p > mc.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size={p} is more than the model's {mc.num_hidden_layers} layers "
            "(every stage needs at least one)"
        )
    if config.nnodes < 1 or (t * p) % config.nnodes:
        raise ValueError(
            f"{t * p} ranks (tensor_parallel_size={t} x pipeline_parallel_size={p}) do not split evenly "
            f"over {config.nnodes} nodes"
        )
    if device_type == "cuda":
        per_node = t * p // config.nnodes
        have = torch.cuda.device_count()
        if per_node > have:
            raise ValueError(
                f"tensor_parallel_size={t} x pipeline_parallel_size={p} needs {per_node} GPUs per node "
                f"({config.nnodes} node(s)), but {have} are present"
            )


def init_parallel(
    config: EngineConfig, rank: int, master_addr: str, master_port: int, device: torch.device
) -> ParallelState:
    """Join the group of config.tensor_parallel_size x pipeline_parallel_size ranks (blocks until all came)."""
    t, p = config.tensor_parallel_size, config.pipeline_parallel_size
    world = t * p
    store = dist.TCPStore(
        master_addr,
        master_port,
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
        wait_for_workers=False,
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    # The default group only rendezvous (its timeout covers ranks that start late); the model's
    # traffic runs on groups with the short collective timeout.
    rendezvous = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=rendezvous)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    world_group = dist.new_group(backend=backend, timeout=timeout)
    tp_ranks = [list(range(s * t, (s + 1) * t)) for s in range(p)]
    groups = [dist.new_group(ranks, backend=backend, timeout=timeout) for ranks in tp_ranks]
    state = ParallelState(
        tp_size=t, pp_size=p, rank=rank, control_group=control, world_group=world_group, tp_ranks=tp_ranks
    )
    state.tp_group = groups[state.pp_rank] if t > 1 else None
    return state


def tp_all_reduce(x: torch.Tensor, par: ParallelState) -> torch.Tensor:
    """Sum x over the tensor-parallel group, in place (row-parallel projections end with this)."""
    if par.tp_group is not None:
        dist.all_reduce(x, group=par.tp_group)
    return x


def tp_gather_vocab(local_logits: torch.Tensor, par: ParallelState, vocab_size: int) -> torch.Tensor:
    """[N, vocab/T] per rank -> [N, vocab] (every rank of the group gets it; rank 0 samples)."""
    if par.tp_group is None:
        return local_logits[:, :vocab_size]
    parts = [torch.empty_like(local_logits) for _ in range(par.tp_size)]
    dist.all_gather(parts, local_logits.contiguous(), group=par.tp_group)
    return torch.cat(parts, dim=1)[:, :vocab_size]
