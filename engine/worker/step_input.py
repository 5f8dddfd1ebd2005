"""One step's batch as a few compact arrays, and its broadcast from rank 0 to every other rank.

Rank 0 (the scheduler) builds a StepInput per step; with several ranks it packs it into one int64
array and writes it into a shared-memory ring its node's ranks read (shm_broadcast.py: no system call,
microseconds); ranks on other nodes get a fixed 8-int header, then the array, over a gloo group.
docs/engine.md has the measured cost. A step with LoRA rows also carries each sequence's adapter id and the
step's adapters (name, id, path as JSON bytes): every rank then fills its slots the same way
(engine/lora/manager.py).
"""

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from tokenmill.engine.lora.peft import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_BYTES
from tokenmill.engine.lora_request import LoRARequest

if TYPE_CHECKING:
    from tokenmill.engine.distributed.parallel_state import ParallelState

HEADER_LEN = 8
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
    # LoRA: each sequence's lora_int_id (0: the base model), empty when no sequence has an adapter
    lora_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    loras: list[LoRARequest] = field(default_factory=list)  # the step's adapters, at most max_loras


def _loras_bytes(loras: list[LoRARequest]) -> bytes:
    return json.dumps([[r.lora_name, r.lora_int_id, r.lora_path] for r in loras]).encode() if loras else b""


def pack(step: StepInput) -> np.ndarray:
    """[header | input_ids | positions | slot_mapping | query_start_loc | seq_lens | block_tables | sample_rows
    | lora_ids | the adapters' JSON, zero-padded to whole int64s]."""
    num_tokens, num_seqs = step.input_ids.size, step.seq_lens.size
    width = step.block_tables.shape[1]
    loras = _loras_bytes(step.loras)
    header = np.array(
        [num_tokens, num_seqs, width, int(step.decode_only), step.sample_rows.size, step.lora_ids.size, len(loras), 0],
        dtype=np.int64,
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
            step.lora_ids,
            np.frombuffer(loras + b"\0" * (-len(loras) % 8), dtype=np.int64),
        ],
        dtype=np.int64,
    )


def unpack(buf: np.ndarray) -> StepInput:
    num_tokens, num_seqs, width, decode_only, num_sampled, num_lora_ids, lora_bytes, _ = (
        int(v) for v in buf[:HEADER_LEN]
    )
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
        lora_ids=take(num_lora_ids, np.int64),
        loras=_unpack_loras(take(-(-lora_bytes // 8), np.int64).tobytes()[:lora_bytes]),
    )


def _unpack_loras(raw: bytes) -> list[LoRARequest]:
    return [LoRARequest(name, lid, path) for name, lid, path in json.loads(raw)] if raw else []


def max_packed_len(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int, max_loras: int = 0
) -> int:
    """The most int64s pack() returns under this config: what the shared-memory ring's chunk holds.
    max_loras: adapters a step may name (0: LoRA off). JSON escapes a character of a name or path in at
    most 12 bytes (a surrogate pair of \\uXXXX), and brackets, quotes, commas and the id take under 40."""
    seqs = min(max_num_seqs, max_num_batched_tokens)
    width = -(-max_model_len // block_size)
    lora = 0
    if max_loras:
        per_adapter = 12 * (MAX_LORA_NAME_CHARS + MAX_LORA_PATH_BYTES) + 40
        lora = seqs + -(-(max_loras * per_adapter + 2) // 8)
    return HEADER_LEN + 3 * max_num_batched_tokens + (seqs + 1) + seqs + seqs * width + seqs + lora


def broadcast_step(step: StepInput | None, par: "ParallelState") -> None:
    """Rank 0: send this step (None: the shutdown message) to every other rank: through the
    shared-memory ring to its own node's ranks, over gloo (a 6-int header, then the array) to the
    ranks of other nodes."""
    if step is None:
        buf = np.zeros(HEADER_LEN, dtype=np.int64)
        buf[0] = SHUTDOWN
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
