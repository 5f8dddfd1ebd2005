"""The torch reference kernels against a naive float64 oracle, plus argument validation."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_kernels_common import (
    assert_close,
    decode_batch,
    make_cache,
    naive_decode,
    naive_prefill,
    prefill_batch,
)
from tokenmill.kernels import (
    check_seq_lens_fit,
    paged_attention_decode,
    paged_attention_prefill,
    reference,
    store_kv,
)

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _lens(bs: int) -> list[int]:
    return [1, bs - 1, bs, bs + 1, 5 * bs + 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_slots_and_skips_minus_one(dtype):
    k_cache, v_cache = make_cache(6, 16, 2, 64, dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(5, 2, 64).to(dtype)
    value = torch.randn(5, 2, 64).to(dtype)
    slots = torch.tensor([17, -1, 0, 95, -1], dtype=torch.int64)
    store_kv(key, value, k_cache, v_cache, slots, impl="torch")
    expected_k, expected_v = k_before.view(-1, 2, 64).clone(), v_before.view(-1, 2, 64).clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot] = key[row]
            expected_v[slot] = value[row]
    assert torch.equal(k_cache.view(-1, 2, 64), expected_k)
    assert torch.equal(v_cache.view(-1, 2, 64), expected_v)
    # slot = block * block_size + offset
    assert torch.equal(k_cache[5, 15], key[3]) and torch.equal(k_cache[1, 1], key[0])


def test_store_kv_all_minus_one_changes_nothing():
    k_cache, v_cache = make_cache(2, 16, 1, 64, torch.float32)
    before = k_cache.clone()
    store_kv(torch.ones(3, 1, 64), torch.ones(3, 1, 64), k_cache, v_cache, torch.full((3,), -1))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8)])
def test_decode_matches_naive(dtype, block_size, num_kv_heads, group):
    lens = _lens(block_size)
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, block_size, num_kv_heads, group, 64, dtype)
    scale = 1 / math.sqrt(64)
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale, impl="torch")
    assert_close(out, naive_decode(q, k_cache, v_cache, table, seq_lens, scale), dtype)


def test_decode_head_dim_128_and_zero_length_rows():
    lens = [0, 33, 1, 0]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 4, 128, torch.float32)
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.1)
    expected = naive_decode(q, k_cache, v_cache, table, seq_lens, 0.1)
    assert_close(out, expected, torch.float32)
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[3]) == 0


def test_decode_many_chunks_matches_naive(monkeypatch):
    # A tiny chunk budget forces many chunks of mixed lengths through the same code the engine
    # uses for 256-sequence batches.
    monkeypatch.setattr(reference, "_CHUNK_KV_BYTES", 3 * 16 * 2 * 2 * 64 * 4)
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 90, (23,), generator=g).tolist()
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 3, 64, torch.float32, seed=3)
    chunks = reference._plan_chunks(lens, [1] * len(lens), 16, 2 * 2 * 64 * 4)
    assert len(chunks) > 5
    assert sorted(i for c in chunks for i in c[0]) == list(range(len(lens)))
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125, impl="torch")
    assert_close(out, naive_decode(q, k_cache, v_cache, table, seq_lens, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (1, 3), (1, 8)])
def test_prefill_matches_naive(dtype, block_size, num_kv_heads, group):
    bs = block_size
    # Fresh prompts of every edge length, chunks starting mid-block after a cached prefix,
    # a chunk starting exactly on a block boundary, a decode-like row and an idle sequence.
    seq_lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, bs + 7, 2 * bs + 5, 2 * bs, 40]
    query_lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 3, bs, bs, 0]
    scale = 1 / math.sqrt(64)
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(
        seq_lens, query_lens, block_size, num_kv_heads, group, 64, dtype
    )
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, scale, impl="torch")
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, scale), dtype)


def test_prefill_long_prompt_tiles_and_head_dim_128(monkeypatch):
    # Shrink the mask budget so one prompt is split into query tiles.
    monkeypatch.setattr(reference, "_CHUNK_MASK_ELEMS", 300)
    seq_lens, query_lens = [70, 45], [70, 20]
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, 16, 2, 2, 128, torch.float32)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, 0.09)
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, 0.09), torch.float32)


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_then_attend_equals_dense_causal_sdpa(block_size):
    """End to end through the cache: chunked prefill then decode equal unpaged causal attention."""
    torch.manual_seed(0)
    num_kv_heads, group, head_dim, n = 2, 3, 64, 50
    num_blocks = 8
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[6, 1, 4, 3]], dtype=torch.int32)[:, : math.ceil((n + 1) / block_size) + 1]
    q = torch.randn(n + 1, num_kv_heads * group, head_dim)
    k = torch.randn(n + 1, num_kv_heads, head_dim)
    v = torch.randn(n + 1, num_kv_heads, head_dim)

    def slots(positions):
        return torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size for p in positions])

    outs = []
    for a, b in ((0, 20), (20, 50)):  # two prefill chunks, the second starting mid-block
        store_kv(k[a:b], v[a:b], k_cache, v_cache, slots(range(a, b)))
        qsl = torch.tensor([0, b - a], dtype=torch.int32)
        outs.append(
            paged_attention_prefill(
                q[a:b], k_cache, v_cache, table, qsl, torch.tensor([b], dtype=torch.int32), 0.125
            )
        )
    store_kv(k[n:], v[n:], k_cache, v_cache, slots([n]))
    outs.append(
        paged_attention_decode(
            q[n:], k_cache, v_cache, table, torch.tensor([n + 1], dtype=torch.int32), 0.125
        )
    )
    got = torch.cat(outs)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.125, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(got, dense, atol=2e-5, rtol=0)


# ---- bad input -------------------------------------------------------------------------------


def _decode_args():
    return decode_batch([5, 20], 16, 2, 2, 64, torch.float32)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda a: a.update(q=a["q"][:, :3]),
            r"q must be \[num_seqs, num_heads \(a multiple of num_kv_heads=2\), head_dim=64\], got \[2, 3, 64\]",
        ),
        (lambda a: a.update(q=a["q"][..., :32]), r"q must be .*head_dim=64.*got \[2, 4, 32\]"),
        (lambda a: a.update(q=a["q"].half()), r"q dtype must equal the cache dtype torch.float32"),
        (
            lambda a: a.update(k_cache=a["k_cache"][0]),
            r"k_cache must be \[num_blocks, block_size, num_kv_heads, head_dim\]",
        ),
        (lambda a: a.update(v_cache=a["v_cache"][:, :8]), r"v_cache must have k_cache's shape"),
        (lambda a: a.update(v_cache=a["v_cache"].double()), r"v_cache dtype must equal"),
        (
            lambda a: a.update(block_tables=a["block_tables"].long()),
            r"block_tables must be torch.int32 \[num_seqs, max_blocks_per_seq\], got dtype torch.int64",
        ),
        (
            lambda a: a.update(block_tables=a["block_tables"][:1]),
            r"block_tables must be \[num_seqs=2, max_blocks_per_seq\], got \[1, 3\]",
        ),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), r"seq_lens must be torch.int32 \[num_seqs\]"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens must be \[num_seqs=2\], got \[1\]"),
        (
            lambda a: a.update(seq_lens=torch.tensor([5, 49], dtype=torch.int32)),
            r"seq_lens\[1\]=49 exceeds what block_tables can hold: max_blocks_per_seq=3 x block_size=16 = 48 tokens",
        ),
        (lambda a: a.update(seq_lens=torch.tensor([-1, 4], dtype=torch.int32)), r"seq_lens must be >= 0"),
    ],
)
def test_decode_bad_input(mutate, match):
    q, k_cache, v_cache, table, seq_lens = _decode_args()
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, seq_lens=seq_lens)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_attention_decode(**args, scale=0.1)


def test_prefill_bad_input():
    q, k_cache, v_cache, table, qsl, lens = prefill_batch([20, 10], [4, 10], 16, 1, 2, 64, torch.float32)
    with pytest.raises(ValueError, match=r"query_start_loc must be torch.int32 \[num_seqs \+ 1\]"):
        paged_attention_prefill(q, k_cache, v_cache, table, qsl.long(), lens, 0.1)
    with pytest.raises(ValueError, match=r"block_tables must be \[num_seqs=1, max_blocks_per_seq\]"):
        paged_attention_prefill(q, k_cache, v_cache, table, qsl[:2], lens, 0.1)
    with pytest.raises(ValueError, match=r"query_start_loc must run from 0 to num_tokens=14, got 0..13"):
        paged_attention_prefill(
            q, k_cache, v_cache, table, torch.tensor([0, 4, 13], dtype=torch.int32), lens, 0.1
        )
    with pytest.raises(ValueError, match=r"sequence 1 has 10 query tokens but seq_lens\[1\]=9"):
        paged_attention_prefill(
            q, k_cache, v_cache, table, qsl, torch.tensor([20, 9], dtype=torch.int32), 0.1
        )
    with pytest.raises(
        ValueError, match=r"seq_lens\[0\]=49 exceeds .*max_blocks_per_seq=3 x block_size=16 = 48 tokens"
    ):
        paged_attention_prefill(
            q, k_cache, v_cache, table, qsl, torch.tensor([49, 10], dtype=torch.int32), 0.1
        )


def test_store_kv_bad_input():
    k_cache, v_cache = make_cache(4, 16, 2, 64, torch.float32)
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(
        ValueError, match=r"key must be \[num_tokens, num_kv_heads=2, head_dim=64\], got \[3, 3, 64\]"
    ):
        store_kv(torch.randn(3, 3, 64), torch.randn(3, 3, 64), k_cache, v_cache, slots)
    with pytest.raises(
        ValueError, match=r"slot_mapping must be torch.int64 \[num_tokens\], got dtype torch.int32"
    ):
        store_kv(key, key, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match=r"slot_mapping must be \[num_tokens=3\]"):
        store_kv(key, key, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match=r"value must have key's shape"):
        store_kv(key, key[:2], k_cache, v_cache, slots)
    with pytest.raises(
        ValueError, match=r"key dtype must equal the cache dtype torch.float32, got torch.bfloat16"
    ):
        store_kv(key.bfloat16(), key.bfloat16(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"must be contiguous"):
        store_kv(key, key, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots)


def test_impl_choice_errors(monkeypatch):
    q, k_cache, v_cache, table, seq_lens = _decode_args()
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'triton', 'cpu', 'torch'\), got 'cuda'"):
        paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.1, impl="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"impl='triton' on a cpu tensor needs TRITON_INTERPRET=1"):
        paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.1, impl="triton")


def test_check_seq_lens_fit_for_device_callers():
    check_seq_lens_fit(torch.tensor([32, 1], dtype=torch.int32), 2, 16)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=33 exceeds .* = 32 tokens"):
        check_seq_lens_fit(torch.tensor([32, 33], dtype=torch.int32), 2, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tolerances_catch_an_off_by_one_token(dtype):
    # The half-precision tolerances are loose enough for rounding, but must still see a kernel that
    # drops the newest token (the classic paged-attention off-by-one).
    lens = [17, 40, 3]
    q, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 3, 64, dtype)
    short = paged_attention_decode(q, k_cache, v_cache, table, seq_lens - 1, 0.125, impl="torch")
    with pytest.raises(AssertionError, match="exceeds atol"):
        assert_close(short, naive_decode(q, k_cache, v_cache, table, seq_lens, 0.125), dtype)


def test_plan_chunks_covers_each_sequence_once_and_bounds_padding():
    # 200 decode rows around one 512-token chunk: the long chunk must not pad the decode rows to
    # 512 query rows each (that would multiply the step's attention work).
    seq_lens = [*range(600, 800), 700]
    query_lens = [1] * 200 + [512]
    chunks = reference._plan_chunks(seq_lens, query_lens, 16, 2 * 3 * 64 * 2)
    assert sorted(i for c in chunks for i in c[0]) == list(range(201))
    for seqs, nb, rows in chunks:
        assert nb * 16 >= max(seq_lens[i] for i in seqs)
        assert rows == max(query_lens[i] for i in seqs)
        assert len(seqs) * rows <= 2 * sum(query_lens[i] for i in seqs)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_strided_q_from_fused_qkv_gives_contiguous_output(num_seqs):
    # The model slices q out of one qkv projection and views the output as [tokens, heads * dim].
    lens = [20, 7, 33][:num_seqs]
    _, k_cache, v_cache, table, seq_lens = decode_batch(lens, 16, 2, 3, 64, torch.float32)
    qkv = torch.randn(num_seqs, (6 + 4) * 64)
    q = qkv[:, : 6 * 64].view(num_seqs, 6, 64)
    assert num_seqs == 1 or not q.is_contiguous()  # one row of a slice is trivially contiguous
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.125)
    assert out.is_contiguous()
    assert_close(out, naive_decode(q, k_cache, v_cache, table, seq_lens, 0.125), torch.float32)
    qsl = torch.tensor([0, *range(1, num_seqs + 1)], dtype=torch.int32)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, seq_lens, 0.125)
    assert out.is_contiguous()
    assert_close(out, naive_decode(q, k_cache, v_cache, table, seq_lens, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "calls"),
    [
        # whole prompts of one length: q's rows viewed in place, SDPA's own causal mask
        ([37, 37, 37], [37, 37, 37], [(True, "causal")]),
        # chunks of one length after cached prefixes: q viewed in place, an explicit mask
        ([50, 50, 50], [20, 20, 20], [(True, "mask")]),
        # chunks of one length after prefixes of different lengths, longest first: still back to back
        ([61, 50, 45], [20, 20, 20], [(True, "mask")]),
        # lengths differ: padded rows gathered from q, an explicit mask
        ([61, 50, 45], [20, 20, 12], [(False, "mask")]),
        # whole prompts of different lengths: padded, SDPA's causal mask (real rows never see the padding)
        ([37, 37, 20], [37, 37, 20], [(False, "causal")]),
        ([45, 37, 20], [45, 30, 20], [(False, "mask")]),  # one of them after a cached prefix
    ],
)
def test_prefill_chunks_of_one_length_match_naive(dtype, seq_lens, query_lens, calls, monkeypatch):
    q, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, query_lens, 16, 2, 3, 64, dtype, seed=7)
    seen = []
    attend = reference._attend_chunk

    def spy(q_pad, *args):
        in_place = q_pad.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
        seen.append((in_place, "causal" if args[3] is None else "mask"))
        return attend(q_pad, *args)

    monkeypatch.setattr(reference, "_attend_chunk", spy)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, 0.125, impl="torch")
    assert seen == calls
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, 0.125), dtype)


def test_prefill_whole_prompts_from_a_fused_qkv_slice():
    # The dense path views q's rows in place: a strided slice of the qkv projection must still work.
    seq_lens = [24, 24]
    _, k_cache, v_cache, table, qsl, lens = prefill_batch(seq_lens, seq_lens, 16, 2, 3, 64, torch.float32)
    qkv = torch.randn(48, (6 + 4) * 64)
    q = qkv[:, : 6 * 64].view(48, 6, 64)
    out = paged_attention_prefill(q, k_cache, v_cache, table, qsl, lens, 0.125, impl="torch")
    assert_close(out, naive_prefill(q, k_cache, v_cache, table, qsl, lens, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_cpu_op_writes_what_the_reference_writes(dtype):
    # On CPU, store_kv (impl auto) runs the C++ op; impl="torch" the reference. Same bytes, -1 skipped.
    k_a, v_a = make_cache(6, 16, 2, 64, dtype, seed=1)
    k_b, v_b = k_a.clone(), v_a.clone()
    g = torch.Generator().manual_seed(3)
    key = torch.randn(9, 2, 64, generator=g).to(dtype)
    value = torch.randn(9, 2, 64, generator=g).to(dtype)
    slots = torch.tensor([5, 17, -1, 40, 95, 0, -1, 64, 33])
    store_kv(key, value, k_a, v_a, slots)
    store_kv(key, value, k_b, v_b, slots, impl="torch")
    assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
    assert torch.equal(k_a.view(-1, 2, 64)[17], key[1]) and torch.equal(v_a.view(-1, 2, 64)[95], value[4])
