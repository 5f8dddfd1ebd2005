"""Which rank this process is, its groups, and the few collectives the model calls.

Layout (as in vLLM): global rank = pp_rank * T + tp_rank. Ranks of one pipeline stage form a tensor
parallel group; rank 0 (stage 0, tp 0) runs the scheduler and the sampler. One world group carries
the model's collectives with a short timeout (a hung rank fails the step); a second, gloo "control"
group carries start-up and shutdown messages, whose waits are unbounded. The per-step broadcast goes
through a shared-memory ring on rank 0's node and a gloo group to the other nodes (step_input.py).
"""

import datetime
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tokenmill.engine import kv_memory
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.distributed import liveness
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.parallel_check import check_parallel_devices, check_parallel_model, check_parallel_shape

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
    # The per-step broadcast (step_input.py): the shared-memory ring of rank 0's node (rank 0 writes,
    # its node's other ranks read), and a gloo group of rank 0 and the other nodes' ranks (None on one node).
    step_ring: object | None = None
    remote_group: object | None = None
    nnodes: int = 1
    collective_timeout_s: float = 60.0
    # Multi-node (liveness.py): rank 0's listening socket, or another node's rank's connection.
    liveness: object | None = None

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def on_leader_node(self) -> bool:
        return self.rank < self.ranks_per_node

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


def validate_parallel(config: EngineConfig, mc: ModelConfig, device_type: str, count_devices: bool = True) -> None:
    """Refuse a TP x PP split this model or machine cannot run, before any weight is read (the rules
    live in parallel_check.py; `tokenmill serve --check` calls this same function). count_devices: False
    where the check plans for GPUs this machine lacks (engine_plan.py)."""
    t, p = config.tensor_parallel_size, config.pipeline_parallel_size
    check_parallel_shape(t, p, config.nnodes)
    check_parallel_model(
        t, p, mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size, mc.num_hidden_layers
    )
    if device_type == "cuda" and count_devices:
        check_parallel_devices(t, p, config.nnodes, torch.cuda.device_count())


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
        tp_size=t, pp_size=p, rank=rank, control_group=control, world_group=world_group, tp_ranks=tp_ranks,
        nnodes=config.nnodes, collective_timeout_s=config.collective_timeout_s,
    )  # fmt: skip
    if config.nnodes > 1:  # every rank creates every group, members or not (torch.distributed's rule)
        remote = [0, *range(state.ranks_per_node, world)]
        group = dist.new_group(remote, backend="gloo", timeout=CONTROL_TIMEOUT)
        state.remote_group = group if rank in remote else None
        if rank == 0:
            state.liveness = liveness.listen(store)
        elif not state.on_leader_node:
            state.liveness = liveness.connect(store, master_addr, rank, RENDEZVOUS_TIMEOUT_S)
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


def all_ranks_ok(ok: bool, par: ParallelState) -> bool:
    """True when every rank passed True. Over the CPU (gloo) control group, so a rank that failed on
    its device can still answer; a collective: every rank calls it the same number of times."""
    if par.world_size == 1:
        return ok
    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=par.control_group)
    return bool(t.item())


def min_on_all_ranks(value: int, par: ParallelState) -> int:
    """The smallest value any rank passed (the KV blocks every rank's pool can hold); a collective."""
    if par.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=par.control_group)
    return int(t.item())


def same_on_all_ranks(values: list[int], par: ParallelState, max_len: int = 64) -> bool:
    """True when every rank passed the same list (of at most max_len non-negative ints)."""
    if par.world_size == 1:
        return True
    if len(values) > max_len:
        raise ValueError(f"same_on_all_ranks takes at most {max_len} values, got {len(values)}")
    t = torch.full((max_len + 1,), -1, dtype=torch.int64)
    t[0] = len(values)
    t[1 : len(values) + 1] = torch.tensor(values, dtype=torch.int64)
    low, high = t.clone(), t.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=par.control_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=par.control_group)
    return bool(torch.equal(low, high))
