"""ModelRunner: builds one flattened batch per step and runs one forward for all its scheduled tokens; owns
the KV pool, the sampler and (CUDA) the captured decode graphs."""

import numpy as np
import torch
import torch.distributed as dist
from tokenmill.engine.distributed.parallel_state import SINGLE, ParallelState, all_ranks_ok, same_on_all_ranks
from tokenmill.engine.layers.attention import AttentionMetadata
from tokenmill.engine.lora.manager import LoRAModelManager
from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.request import Request
from tokenmill.engine.worker.cuda_graphs import CUDAGraphRunner
from tokenmill.engine.worker.huge_pages import zeros_huge_pages
from tokenmill.engine.worker.sampler import Sampler
from tokenmill.engine.worker.step_input import StepInput, broadcast_step
from tokenmill.kernels import kv_quant


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: torch.dtype | None = None,
        enforce_eager: bool = False,
        hidden_size: int = 0,
        par: ParallelState = SINGLE,
        lora: LoRAModelManager | None = None,
    ) -> None:
        """model: loaded and packed (Worker); num_layers / num_kv_heads: this rank's (its pipeline stage's
        layers, its KV heads); lora: the adapter slots attached to the model (before any graph captures)."""
        self.model = model
        self.lora = lora
        self.device = device
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.par = par
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # One allocation for the whole pool: [layers, K/V, blocks, block_size, kv_heads, head_dim]; on
        # the CPU on huge pages (huge_pages.py: attention reads it a block at a time, all over the pool).
        # An 8-bit cache's rows are head_dim codes and a 4-byte scale (kernels/kv_quant.py). None: dtype.
        kv_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        width = head_dim + (kv_quant.KV_SCALE_BYTES if kv_dtype in kv_quant.KV_QMAX else 0)
        pool_shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, width)
        if device.type == "cpu":
            self.kv_pool = zeros_huge_pages(pool_shape, kv_dtype)
        else:
            self.kv_pool = torch.zeros(pool_shape, dtype=kv_dtype, device=device)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(num_layers)]
        # Reused every step instead of reallocated.
        self.block_table_buf = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.sampler = Sampler(vocab_size, device)
        self.graphs: CUDAGraphRunner | None = None
        # Graphs per rank under TP (every rank captures the same sizes, or all stay eager: cuda_graphs.py);
        # pipeline parallel stays eager (its stage-to-stage sends are not captured; docs/engine.md).
        if device.type == "cuda" and not enforce_eager and par.pp_size == 1:
            self.graphs = CUDAGraphRunner(
                model, self.kv_caches, max_num_seqs, self.max_blocks_per_seq, max_model_len, device
            )
            self.graphs.capture(lambda ok: all_ranks_ok(ok, par), lambda sizes: same_on_all_ranks(sizes, par))

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], block_ids: list[list[int]]
    ) -> tuple[list[int], list[TokenLogprobs | None], list[Request]]:
        """Run the step (rank 0: on every rank). Returns sampled tokens (and logprobs) for the sequences
        whose scheduled tokens reach their end; mid-prompt chunks sample nothing."""
        if self.lora is not None and any(r.lora_request is not None for r, _ in scheduled):
            # Sequences of one adapter side by side (base first): the grouped LoRA product then reads its
            # rows as contiguous groups (layers/lora.py). The returned `reqs` follow this order.
            order = sorted(range(len(scheduled)), key=lambda i: _lora_id(scheduled[i][0]))
            scheduled, block_ids = [scheduled[i] for i in order], [block_ids[i] for i in order]
        step = self.prepare(scheduled, block_ids)
        par = self.par
        if par.world_size > 1:
            broadcast_step(step, par)
        logits = self.forward(step)
        if not step.sample_rows.size:
            return [], [], []
        if par.pp_size > 1:  # the last stage computed them; its first rank sends them here
            logits = torch.empty(step.sample_rows.size, self.vocab_size, dtype=torch.float32, device=self.device)
            dist.recv(logits, src=par.stage_rank(par.pp_size - 1), group=par.world_group)
        reqs = [r for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens]
        tokens, logprobs = self.sampler(logits, reqs)
        return tokens, logprobs, reqs

    def prepare(self, scheduled: list[tuple[Request, int]], block_ids: list[list[int]]) -> StepInput:
        """The step's flattened batch as compact arrays: what every rank needs to run its forward."""
        num_seqs = len(scheduled)
        bs = self.block_size
        num_new = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=num_seqs)
        start = np.fromiter((r.num_computed_tokens for r, _ in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = start + num_new
        decode_only = bool((num_new == 1).all())

        if decode_only:
            input_ids = np.fromiter((r.token_ids[-1] for r, _ in scheduled), dtype=np.int64, count=num_seqs)
            positions = start
        else:
            ids: list[int] = []
            for (r, n), s in zip(scheduled, start.tolist(), strict=True):
                ids.extend(r.token_ids[s : s + n])
            input_ids = np.array(ids, dtype=np.int64)
            # positions = start[i] + 0..num_new[i]-1 for each sequence, without a Python loop
            seq_of_token = np.repeat(np.arange(num_seqs), num_new)
            cu = np.cumsum(num_new) - num_new
            positions = start[seq_of_token] + (np.arange(seq_of_token.size) - cu[seq_of_token])

        width = max(len(b) for b in block_ids)
        table = self.block_table_buf[:num_seqs, :width]
        for i, b in enumerate(block_ids):
            table[i, : len(b)] = b
        seq_of_token = np.arange(num_seqs) if decode_only else np.repeat(np.arange(num_seqs), num_new)
        slot_mapping = table[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        sampling = [i for i, (r, n) in enumerate(scheduled) if r.num_computed_tokens + n == r.num_tokens]
        last_token = query_start_loc[1:] - 1
        lora_ids, loras = np.zeros(0, dtype=np.int64), []
        if self.lora is not None and any(r.lora_request is not None for r, _ in scheduled):
            lora_ids = np.fromiter((_lora_id(r) for r, _ in scheduled), dtype=np.int64, count=num_seqs)
            loras = list({r.lora_request.lora_int_id: r.lora_request for r, _ in scheduled if r.lora_request}.values())
        return StepInput(
            input_ids=input_ids,
            positions=np.ascontiguousarray(positions, dtype=np.int64),
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=table.copy(),
            sample_rows=last_token[sampling].astype(np.int64),
            decode_only=decode_only,
            lora_ids=lora_ids,
            loras=loras,
        )

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor | None:
        """This rank's part of the step: its stage's layers over its heads. Returns the fp32 logits
        [num_sampled, vocab] on the last stage (None elsewhere, and when nothing is sampled)."""
        dev, par = self.device, self.par
        num_seqs = step.seq_lens.size
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(step.slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(step.query_start_loc).to(dev),
            seq_lens=torch.from_numpy(step.seq_lens).to(dev),
            block_tables=torch.from_numpy(step.block_tables).to(dev),
            decode_only=step.decode_only,
            max_query_len=int(np.diff(step.query_start_loc).max()),
            max_seq_len=int(step.seq_lens.max()),
        )
        if self.lora is not None:  # this step's rows -> adapter slots, for every layer's projections
            num_new = None if step.decode_only else np.diff(step.query_start_loc)
            self.lora.set_step(step.lora_ids, num_new, step.loras)
        ids_t = torch.from_numpy(step.input_ids).to(dev)
        pos_t = torch.from_numpy(step.positions).to(dev)
        stage_input = None
        if not par.is_first_stage:  # hidden state and residual from the previous stage
            shape = (step.input_ids.size, self.hidden_size)
            stage_input = (torch.empty(shape, dtype=self.dtype, device=dev), torch.empty(shape, dtype=self.dtype, device=dev))
            for t in stage_input:
                dist.recv(t, src=par.stage_rank(par.pp_rank - 1), group=par.world_group)
        if step.decode_only and self.graphs is not None and self.graphs.can_run(num_seqs):
            hidden = self.graphs.run(ids_t, pos_t, md.slot_mapping, md.seq_lens, md.block_tables)
        else:
            hidden = self.model(ids_t, pos_t, self.kv_caches, md, stage_input)
        if not par.is_last_stage:
            for t in hidden:
                dist.send(t.contiguous(), dst=par.stage_rank(par.pp_rank + 1), group=par.world_group)
            return None
        if not step.sample_rows.size:
            return None
        idx = torch.from_numpy(step.sample_rows).to(dev)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        if par.pp_size > 1 and par.tp_rank == 0:
            dist.send(logits, dst=0, group=par.world_group)
        return logits


def _lora_id(req: Request) -> int:
    return 0 if req.lora_request is None else req.lora_request.lora_int_id
