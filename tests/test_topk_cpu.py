"""The sampler's top-k kernel (kernels/csrc/cpu_topk.cpp) against torch.topk: the same values in the
same order, indices that hold them, and the same index set wherever the k-th value is not tied."""

import pytest
import torch
from tokenmill.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the C++ kernels")


@pytest.mark.parametrize(("m", "v", "k"), [(64, 49152, 64), (1, 49152, 64), (4, 49152, 1024), (3, 100, 100),
                                           (5, 37, 1), (3, 1000, 7)])  # fmt: skip
def test_topk_rows_matches_torch(m: int, v: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * v + k)
    x = torch.randn(m, v, generator=g) * 3
    x[0, ::3] = float("-inf")  # masked logits
    if m > 1:
        x[1] = torch.randint(0, 5, (v,), generator=g).float()  # ties everywhere
    if m > 2:
        x[2] = float("-inf")  # fewer finite values than k (where k > 1)
        x[2, 5] = 1.0
    got_v, got_i = cpu_kernels.load().topk_rows(x, k)
    want_v, want_i = x.topk(k, dim=-1)
    assert torch.equal(got_v, want_v)
    assert torch.equal(torch.gather(x, 1, got_i), got_v)
    assert all(len(set(row.tolist())) == k for row in got_i)
    for r in range(m):
        if (x[r] == want_v[r, -1]).sum() == 1:
            assert set(got_i[r].tolist()) == set(want_i[r].tolist())
    if m > 1 and k < v:  # ties at the k-th value: the lowest indices holding it
        tied = got_v[1] == got_v[1, -1]
        boundary = torch.nonzero(x[1] == got_v[1, -1]).view(-1)
        assert set(got_i[1][tied].tolist()) == set(boundary[: int(tied.sum())].tolist())


def test_topk_rows_refuses_what_it_cannot_take() -> None:
    ops = cpu_kernels.load()
    with pytest.raises(RuntimeError, match=r"k must be in 1..10 \(the row length\), got 11"):
        ops.topk_rows(torch.zeros(2, 10), 11)
    with pytest.raises(RuntimeError, match="x must be 2-D float32 with contiguous rows"):
        ops.topk_rows(torch.zeros(2, 10, dtype=torch.float64), 3)
