"""One step's batch as a few compact arrays, and its broadcast from rank 0 to every other rank.

Rank 0 (the scheduler) builds a StepInput per step; with several ranks it packs it into one int64
array and writes it into a shared-memory ring its node's ranks read (shm_broadcast.py: no system call,
microseconds); ranks on other nodes get a fixed 6-int header, then the array, over a gloo group.
docs/engine.md has the measured cost.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tokenmill.engine.distributed.parallel_state import ParallelState

HEADER_LEN = 6
SHUTDOWN = -1  # header[0] of the message that tells the workers to exit


@dataclass(slots=True)
class StepInput:
    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    seq_lens: np.ndarray  # int32 [num_seqs]
    block_tables: np.ndarray  # int32 [num_seqs, width]
    sample_rows: np.ndarray  # int64 [num_sampled]: token rows whose logits are sampled
    decode_only: bool


def pack(step: StepInput) -> np.ndarray:
    """[header | input_ids | positions | slot_mapping | query_start_loc | seq_lens | block_tables | sample_rows]."""
    num_tokens, num_seqs = step.input_ids.size, step.seq_lens.size
    width = step.block_tables.shape[1]
    header = np.array(
        [num_tokens, num_seqs, width, int(step.decode_only), step.sample_rows.size, 0], dtype=np.int64
    )
    return np.concatenate(
        [
            header,
            step.input_ids,
            step.positions,
            step.slot_mapping,
            step.query_start_loc,
            step.seq_lens,
            step.block_tables.reshape(-1),
            step.sample_rows,
        ],
        dtype=np.int64,
    )


def unpack(buf: np.ndarray) -> StepInput:
    num_tokens, num_seqs, width, decode_only, num_sampled, _ = (int(v) for v in buf[:HEADER_LEN])
    pos = HEADER_LEN

    def take(n: int, dtype: type) -> np.ndarray:
        nonlocal pos
        out = buf[pos : pos + n].astype(dtype, copy=False)
        pos += n
        return out

    return StepInput(
        input_ids=take(num_tokens, np.int64),
        positions=take(num_tokens, np.int64),
        slot_mapping=take(num_tokens, np.int64),
        query_start_loc=take(num_seqs + 1, np.int32),
        seq_lens=take(num_seqs, np.int32),
        block_tables=take(num_seqs * width, np.int32).reshape(num_seqs, width),
        sample_rows=take(num_sampled, np.int64),
        decode_only=bool(decode_only),
    )


def max_packed_len(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int
) -> int:
    """The most int64s pack() returns under this config: what the shared-memory ring's chunk holds."""
    seqs = min(max_num_seqs, max_num_batched_tokens)
    width = -(-max_model_len // block_size)
    return HEADER_LEN + 3 * max_num_batched_tokens + (seqs + 1) + seqs + seqs * width + seqs


def broadcast_step(step: StepInput | None, par: "ParallelState") -> None:
    """Rank 0: send this step (None: the shutdown message) to every other rank: through the
    shared-memory ring to its own node's ranks, over gloo (a 6-int header, then the array) to the
    ranks of other nodes."""
    if step is None:
        buf = np.array([SHUTDOWN, 0, 0, 0, 0, 0], dtype=np.int64)
    else:
        buf = pack(step)
    if par.step_ring is not None:
        par.step_ring.write(buf, par.collective_timeout_s)
    if par.remote_group is not None:
        t = torch.from_numpy(buf)
        header = t[:HEADER_LEN].clone()
        header[HEADER_LEN - 1] = t.numel()
        dist.broadcast(header, src=0, group=par.remote_group)
        if step is not None:
            dist.broadcast(t, src=0, group=par.remote_group)


def receive_step(par: "ParallelState") -> StepInput | None:
    """Other ranks: block until rank 0 sends the next step; None means shut down."""
    if par.step_ring is not None:
        buf = par.step_ring.read().view(np.int64)
    else:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0, group=par.remote_group)
        if int(header[0]) == SHUTDOWN:
            return None
        t = torch.empty(int(header[HEADER_LEN - 1]), dtype=torch.int64)
        dist.broadcast(t, src=0, group=par.remote_group)
        buf = t.numpy()
    if int(buf[0]) == SHUTDOWN:
        return None
    return unpack(buf)
