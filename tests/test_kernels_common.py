"""Shared builders and a naive oracle for the kernel tests (defines no tests itself).

The oracle gathers each sequence's K/V one block at a time with Python lists, repeats KV heads
(transformers' repeat_kv) and runs textbook softmax attention in float64, so it shares no code or
tricks with tokenmill.kernels.
"""

import math

import torch

# |out - expected| <= atol + rtol * |expected|, elementwise. fp32 is accumulation-order noise. Half
# precisions store q/k/v exactly (the oracle reads the same rounded values) but round the softmax
# probabilities and the output once: rtol covers ~2 output ulps (outputs reach |4| for 1-token
# sequences, where one bf16 ulp is 0.03), atol covers accumulated probability rounding near 0.
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1.5e-3, 4e-3), torch.bfloat16: (1e-2, 1.6e-2)}


def assert_close(out, expected, dtype, what=""):
    """out (dtype) against expected (any float dtype) within TOL[dtype]; the message gives the worst gap."""
    assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    atol, rtol = TOL[dtype]
    diff = (out.double() - expected.double()).abs()
    excess = diff - (atol + rtol * expected.double().abs())
    worst = int(excess.argmax()) if excess.numel() else 0
    assert excess.numel() == 0 or excess.max() <= 0, (
        f"{what}: max abs error {diff.max().item():.3g}; worst element error {diff.flatten()[worst].item():.3g} "
        f"at |expected|={expected.double().abs().flatten()[worst].item():.3g} exceeds atol={atol} + rtol={rtol}"
    )


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return k, v


def shuffled_tables(seq_lens, block_size, num_blocks, extra_cols=1, seed=0):
    """Block tables drawing distinct blocks in a random order; unused entries are -1 padding."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max([*need, 1]) + extra_cols
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
    return table


def naive_kv(cache, table_row, seq_len):
    """[seq_len, num_kv_heads, head_dim] float64, gathered block by block."""
    block_size = cache.shape[1]
    rows = []
    for t in range(seq_len):
        block = int(table_row[t // block_size])
        rows.append(cache[block, t % block_size].double())
    return torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:]).double()


def naive_attention(q_rows, k, v, q_positions, scale):
    """q_rows [n, H, D]; k, v [L, KVH, D]; row j sees keys 0..q_positions[j]. Returns float64 [n, H, D]."""
    num_heads, num_kv_heads = q_rows.shape[1], k.shape[1]
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    out = torch.zeros(q_rows.shape, dtype=torch.float64)
    for j, pos in enumerate(q_positions):
        for h in range(num_heads):
            s = (k[: pos + 1, h] @ q_rows[j, h].double()) * scale
            p = torch.softmax(s, dim=0)
            out[j, h] = p @ v[: pos + 1, h]
    return out


def naive_decode(q, k_cache, v_cache, table, seq_lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k = naive_kv(k_cache, table[i], n)
        v = naive_kv(v_cache, table[i], n)
        out[i] = naive_attention(q[i : i + 1], k, v, [n - 1], scale)[0]
    return out


def naive_prefill(q, k_cache, v_cache, table, query_start_loc, seq_lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        a, b = qsl[i], qsl[i + 1]
        if a == b:
            continue
        k = naive_kv(k_cache, table[i], n)
        v = naive_kv(v_cache, table[i], n)
        positions = list(range(n - (b - a), n))
        out[a:b] = naive_attention(q[a:b], k, v, positions, scale)
    return out


def prefill_batch(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    """A prefill batch: seq i has seq_lens[i] cached tokens, the last query_lens[i] of them queried."""
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed)
    table = shuffled_tables(seq_lens, block_size, num_blocks, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, table, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def decode_batch(seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed)
    table = shuffled_tables(seq_lens, block_size, num_blocks, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32)
