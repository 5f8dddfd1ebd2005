"""engine/layers/attention.py's direct C++ path (the layers after a step's first) against the kernels/ops.py
path it skips: the C++ store_kv against the torch reference, and whole attention layers bit for bit."""

import torch
from tiny_models import build_step, make_kv_caches
from tokenmill.engine.layers import attention
from tokenmill.kernels import cpu, reference

torch.set_num_threads(1)


def test_store_kv_matches_reference_with_skipped_slots_and_strided_rows():
    ops = cpu.load()
    assert ops is not None, f"C++ CPU kernels failed to build: {cpu.unavailable_reason()}"
    g = torch.Generator().manual_seed(3)
    num_kv_heads, head_dim = 3, 64
    # key/value as the model passes them: column slices of one q|k|v row (row stride > heads * head_dim)
    qkv = torch.randn(5, (9 + 2 * num_kv_heads) * head_dim, generator=g)
    key = qkv[:, 9 * head_dim : (9 + num_kv_heads) * head_dim].view(5, num_kv_heads, head_dim)
    value = qkv[:, (9 + num_kv_heads) * head_dim :].view(5, num_kv_heads, head_dim)
    slots = torch.tensor([7, -1, 0, 33, -1], dtype=torch.int64)
    (k_ref, v_ref), (k_out, v_out) = make_kv_caches(2, 4, 16, num_kv_heads, head_dim, torch.float32)
    k_ref.fill_(0.5)
    k_out.fill_(0.5)
    reference.store_kv_torch(key, value, k_ref, v_ref, slots)
    ops.store_kv(k_out, v_out, key, value, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    assert torch.count_nonzero(k_out != 0.5) > 0  # something was written


def test_store_kv_rejects_a_slot_outside_the_cache():
    ops = cpu.load()
    k_cache, v_cache = make_kv_caches(1, 2, 16, 1, 64, torch.float32)[0]
    key = torch.ones(1, 1, 64)
    try:
        ops.store_kv(k_cache, v_cache, key, key, torch.tensor([32], dtype=torch.int64))
    except RuntimeError as e:
        assert "outside the cache" in str(e)
    else:
        raise AssertionError("a slot past the cache's end was written")


def _layers(md, caches, qs, ks, vs):
    return [
        attention.paged_attention(q, k, v, kc, vc, md, 0.125) for q, k, v, (kc, vc) in zip(qs, ks, vs, caches, strict=True)
    ]


def test_direct_path_gives_the_ops_path_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    tables = [[0, 1, 2], [3, 4], [5]]
    # a decode row, a prompt chunk after a cached prefix, a fresh prompt: one mixed step
    _, md_a = build_step(tables, [20, 5, 0], [1, 9, 7], 16)
    _, md_b = build_step(tables, [20, 5, 0], [1, 9, 7], 16)
    n = 17
    qs = [torch.randn(n, 6, 64, generator=g) for _ in range(3)]
    ks = [torch.randn(n, 2, 64, generator=g) for _ in range(3)]
    vs = [torch.randn(n, 2, 64, generator=g) for _ in range(3)]
    caches_a = make_kv_caches(3, 6, 16, 2, 64, torch.float32)
    caches_b = make_kv_caches(3, 6, 16, 2, 64, torch.float32)
    for (kc, _), (kc2, _) in zip(caches_a, caches_b, strict=True):  # the cached prefixes' K (same in both)
        kc.copy_(torch.randn(kc.shape, generator=g))
        kc2.copy_(kc)
    out_a = _layers(md_a, caches_a, qs, ks, vs)
    assert md_a.cpu_direct is not None  # layers 2 and 3 went through the C++ ops directly
    md_b.validated = True  # every layer through kernels/ops.py
    orig = attention._cpu_direct
    try:
        attention._cpu_direct = lambda q, md: None
        out_b = _layers(md_b, caches_b, qs, ks, vs)
    finally:
        attention._cpu_direct = orig
    assert md_b.cpu_direct is None
    for a, b in zip(out_a, out_b, strict=True):
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_chunk_too_big_for_the_kernel_keeps_the_ops_path(monkeypatch):
    monkeypatch.setattr(attention, "too_big_for_cpu_kernel", lambda rows, seq_len, dtype: rows > 4)
    _, md = build_step([[0, 1]], [0], [9], 16)
    q = torch.randn(9, 6, 64)
    k = torch.randn(9, 2, 64)
    kc, vc = make_kv_caches(1, 2, 16, 2, 64, torch.float32)[0]
    attention.paged_attention(q, k, k.clone(), kc, vc, md, 0.125)
    assert md.validated and md.cpu_direct is None
