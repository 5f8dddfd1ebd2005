"""Builds one flattened batch per step and runs one forward for all scheduled tokens."""

import numpy as np
import torch
from tokenmill.engine.attention import AttentionMetadata
from tokenmill.engine.cuda_graphs import CUDAGraphRunner
from tokenmill.engine.layers import can_prepack
from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.request import Request
from tokenmill.engine.sampler import Sampler


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
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        if can_prepack(device, dtype) and hasattr(model, "prepack_linears"):
            model.prepack_linears()
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # One allocation for the whole pool: [layers, K/V, blocks, block_size, kv_heads, head_dim].
        self.kv_pool = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(num_layers)]
        # Reused every step instead of reallocated.
        self.block_table_buf = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.sampler = Sampler(vocab_size, device)
        self.graphs: CUDAGraphRunner | None = None
        if device.type == "cuda" and not enforce_eager:
            self.graphs = CUDAGraphRunner(
                model, self.kv_caches, max_num_seqs, self.max_blocks_per_seq, max_model_len, device
            )
            self.graphs.capture()

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], block_ids: list[list[int]]
    ) -> tuple[list[int], list[TokenLogprobs | None], list[Request]]:
        """Run the step. Returns sampled tokens (and logprobs) for the sequences whose scheduled tokens
        reach their end; mid-prompt chunks sample nothing."""
        num_seqs = len(scheduled)
        bs = self.block_size
        num_new = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=num_seqs)
        start = np.fromiter((r.num_computed_tokens for r, _ in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = start + num_new
        decode_only = bool((num_new == 1).all())

        if decode_only:
            input_ids = [r.token_ids[-1] for r, _ in scheduled]
            positions = start
        else:
            input_ids = []
            for (r, n), s in zip(scheduled, start.tolist(), strict=True):
                input_ids.extend(r.token_ids[s : s + n])
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
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(table.copy()).to(dev),
            decode_only=decode_only,
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
        )
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(dev)
        if decode_only and self.graphs is not None and self.graphs.can_run(num_seqs):
            hidden = self.graphs.run(ids_t, pos_t, md.slot_mapping, md.seq_lens, md.block_tables)
        else:
            hidden = self.model(ids_t, pos_t, self.kv_caches, md)

        sampling = [i for i, (r, n) in enumerate(scheduled) if r.num_computed_tokens + n == r.num_tokens]
        if not sampling:
            return [], [], []
        last_token = query_start_loc[1:] - 1
        idx = torch.from_numpy(last_token[sampling].astype(np.int64)).to(dev)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        reqs = [scheduled[i][0] for i in sampling]
        tokens, logprobs = self.sampler(logits, reqs)
        return tokens, logprobs, reqs
