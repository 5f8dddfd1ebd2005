"""Plain-torch paged attention and KV writes: the CPU serving path and the oracle for the Triton kernels.

Cache layout (shared with the Triton kernels and the engine): k_cache/v_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
block_tables[seq, t // block_size] at offset t % block_size. Query head h reads KV head
h // (num_heads // num_kv_heads), the same grouping as transformers' repeat_kv.

How it stays fast on a CPU: sequences are sorted by length and processed in chunks whose gathered
K/V fit a few MiB, so one Python iteration covers many short sequences (no per-sequence loop),
padding stays small, the gathered blocks stay in cache, and large short-lived allocations (which
cost page faults on every step) are avoided. Each chunk is one call to torch's fused SDPA, which
accumulates scores and softmax in fp32 for half-precision inputs and handles GQA without copying K/V.
Outputs come back in q's dtype. An 8-bit cache (kernels/kv_quant.py) is gathered as stored and dequantized
to q's dtype before SDPA; its writes go through kv_quant.quantize_rows.
"""

import torch
import torch.nn.functional as F
from tokenmill.kernels import kv_quant

_CHUNK_KV_BYTES = 4 << 20  # gathered K+V per chunk; 1-8 MiB measured best here (0.5 and 16 MiB were slower)
_CHUNK_MASK_ELEMS = 1 << 24  # query rows x keys per chunk: bounds mask/score memory for long prompts


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value rows [num_tokens, num_kv_heads, head_dim] into their slots; slot -1 is skipped."""
    if key.shape[0] == 0:
        return
    _, _, num_kv_heads, width = k_cache.shape
    k_flat = k_cache.view(-1, num_kv_heads, width)
    v_flat = v_cache.view(-1, num_kv_heads, width)
    if kv_quant.is_quantized(k_cache):  # whole rows (codes and scale), copied as bytes (no fp8 index_copy_)
        key = kv_quant.quantize_rows(key, k_cache.dtype).view(torch.uint8)
        value = kv_quant.quantize_rows(value, v_cache.dtype).view(torch.uint8)
        k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
    valid = slot_mapping >= 0
    if slot_mapping.device.type == "cpu" and bool(valid.all()):
        # The common case (no padding tokens) skips the boolean compaction.
        k_flat.index_copy_(0, slot_mapping, key)
        v_flat.index_copy_(0, slot_mapping, value)
        return
    slots = slot_mapping[valid]
    k_flat.index_copy_(0, slots, key[valid])
    v_flat.index_copy_(0, slots, value[valid])


def _kv_bytes_per_token(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Gathered K+V bytes per token as SDPA reads them (an 8-bit cache's dequantized copy is q's dtype)."""
    size = q.element_size() if kv_quant.is_quantized(k_cache) else k_cache.element_size()
    return 2 * k_cache.shape[2] * q.shape[-1] * size


def _plan_chunks(
    seq_lens: list[int], query_lens: list[int], block_size: int, kv_bytes_per_token: int
) -> list[tuple[list[int], int, int]]:
    """Group sequences (longest first) into (seq indices, padded blocks, padded query rows) chunks."""
    order = sorted(
        (i for i, n in enumerate(seq_lens) if n > 0 and query_lens[i] > 0), key=lambda i: -seq_lens[i]
    )
    token_budget = max(1, _CHUNK_KV_BYTES // kv_bytes_per_token)
    chunks = []
    start = 0
    while start < len(order):
        nb = -(-seq_lens[order[start]] // block_size)  # the chunk's first sequence is its longest
        padded = nb * block_size
        rows = real_rows = query_lens[order[start]]
        end = start + 1
        while end < len(order):
            rows_next = max(rows, query_lens[order[end]])
            real_next = real_rows + query_lens[order[end]]
            size = end + 1 - start
            if (
                size * padded > token_budget
                or size * rows_next * padded > _CHUNK_MASK_ELEMS
                or size * rows_next > 2 * real_next  # e.g. decode rows beside a long prefill chunk
            ):
                break
            rows, real_rows = rows_next, real_next
            end += 1
        chunks.append((order[start:end], nb, rows))
        start = end
    return chunks


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """The blocks block_ids ([num_seqs * nb], flattened) as [num_seqs, nb * block_size, kv_heads, head_dim]
    of `dtype` (the query's: an 8-bit cache is dequantized after the gather, so only its bytes are copied)."""
    num_blocks, _, num_kv_heads, width = cache.shape
    flat = cache.view(num_blocks, -1)
    if cache.device.type == "cpu" and flat.shape[1] * cache.element_size() % 8 == 0:
        # Copy 8-byte words: index_select on bf16/fp16/fp32 rows is several times slower on CPU than on
        # the same bytes viewed as int64 (measured with kernels/bench_cpu.py).
        rows = flat.view(torch.int64).index_select(0, block_ids).view(cache.dtype)
    else:
        rows = flat.index_select(0, block_ids)
    rows = rows.view(num_seqs, -1, num_kv_heads, width)
    return kv_quant.dequantize_rows(rows, dtype) if kv_quant.is_quantized(cache) else rows


def _attend_chunk(
    q_pad: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    q_pos: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q_pad [s, n, H, D] at absolute positions q_pos [s, n]; each row sees keys 0..q_pos. -> [s, n, H, D].

    q_pos None: row i is at position i (whole prompts, no cached prefix), SDPA's own causal mask."""
    num_seqs = q_pad.shape[0]
    k = _gather_kv(k_cache, block_ids, num_seqs, q_pad.dtype)  # [s, L, KVH, D]
    v = _gather_kv(v_cache, block_ids, num_seqs, q_pad.dtype)
    mask = None
    if q_pos is not None:
        key_pos = torch.arange(k.shape[1], device=q_pad.device)
        mask = (key_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [s, 1, n, L]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=q_pos is None,  # top-left aligned: row i sees keys 0..i, the padding keys past L never
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def paged_attention_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its whole cached context. q: [num_seqs, num_heads, head_dim].

    A sequence with seq_len 0 (e.g. batch padding) gets a zero output.
    """
    num_seqs = q.shape[0]
    block_size = k_cache.shape[1]
    lens = seq_lens.tolist()
    kv_bytes = _kv_bytes_per_token(q, k_cache)
    chunks = _plan_chunks(lens, [1] * num_seqs, block_size, kv_bytes)
    q_pos = (seq_lens.long() - 1)[:, None]
    if len(chunks) == 1 and len(chunks[0][0]) == num_seqs:
        # Small batches: one chunk in the caller's order, so no index/scatter ops (they dominate
        # the cost of a batch-1 step).
        block_ids = block_tables[:, : chunks[0][1]].clamp_min(0).flatten()
        o = _attend_chunk(q[:, None], k_cache, v_cache, block_ids, q_pos, scale)
        return o.reshape(q.shape)
    out = q.new_zeros(q.shape)
    for seqs, nb, _ in chunks:
        idx = torch.tensor(seqs, device=q.device)
        block_ids = block_tables[idx, :nb].clamp_min(0).flatten()  # -1 padding past the end stays in range
        o = _attend_chunk(q[idx][:, None], k_cache, v_cache, block_ids, q_pos[idx], scale)
        out.index_copy_(0, idx, o[:, 0])
    return out


def paged_attention_prefill_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Variable-length query chunks; chunk i holds the last (qsl[i+1]-qsl[i]) of seq_lens[i] tokens.

    The query token at absolute position p attends to cached tokens 0..p (its prefix and itself).
    Chunks of different lengths share one SDPA call by padding query rows: a padded row repeats the
    chunk's last real row and is dropped afterwards.
    """
    block_size = k_cache.shape[1]
    out = q.new_empty(q.shape)  # contiguous even when q is a strided slice of a fused qkv
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    kv_bytes = _kv_bytes_per_token(q, k_cache)
    for seqs, nb, rows in _plan_chunks(lens, query_lens, block_size, kv_bytes):
        idx = torch.tensor(seqs, device=q.device)
        block_ids = block_tables[idx, :nb].clamp_min(0).flatten()
        qlen = torch.tensor([query_lens[i] for i in seqs], device=q.device)
        r = torch.arange(rows, device=q.device)[None, :]
        row_in_chunk = torch.minimum(r, qlen[:, None] - 1)  # [s, rows]; padded rows repeat the last real one
        # Whole prompts (no cached prefix): row i sits at position i, so SDPA's own causal mask is the
        # right one, padding or not (a real row never reaches the padding keys past its prompt), and
        # it lets SDPA skip the masked half (38.7 -> 18.1 ms for a 2,048-token prompt, bf16).
        whole = all(lens[i] == query_lens[i] for i in seqs)
        q_pos = None if whole else (seq_lens[idx].long() - qlen)[:, None] + row_in_chunk
        first0 = starts[seqs[0]]
        if all(query_lens[i] == rows and starts[i] == first0 + j * rows for j, i in enumerate(seqs)):
            # Chunks of one length, back to back (a step of equal prompts): no padding, so q's rows are a
            # view and the output one slice; the gathers and masked copies below cost more than the
            # attention itself for 128-token prompts (2.6 of 8.6 ms per layer for 16 prompts, bf16).
            span = slice(first0, first0 + len(seqs) * rows)
            o = _attend_chunk(q[span].unflatten(0, (len(seqs), rows)), k_cache, v_cache, block_ids, q_pos, scale)
            out[span] = o.flatten(0, 1)
            continue
        first = torch.tensor([starts[i] for i in seqs], device=q.device)
        src = (first[:, None] + row_in_chunk).flatten()
        # index_select, not q[src] / o[real]: advanced indexing took 6.1 ms for 2,048 bf16 rows of 9 x 64
        # where index_select took 0.5, and the boolean pick 1.7 ms against 0.13 (2 threads).
        q_pad = q.index_select(0, src).unflatten(0, (len(seqs), rows))
        o = _attend_chunk(q_pad, k_cache, v_cache, block_ids, q_pos, scale)  # [s, rows, H, D]
        keep = (r < qlen[:, None]).flatten().nonzero().squeeze(1)
        out.index_copy_(0, src.index_select(0, keep), o.flatten(0, 1).index_select(0, keep))
    return out
