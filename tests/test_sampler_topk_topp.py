"""The sampler's top-K path keeps exactly the distribution of a full sort over the vocabulary.

The reference below is written out from the definitions (float64, a stable sort, so ties rank by lower
token id): top_k, then top_p over the renormalized top_k (the smallest prefix whose mass reaches top_p),
then min_p relative to the top token. The sampler keeps rows whose kept set provably fits in the K most
likely tokens on the top-K path and sends the rest through the full sort; both are compared with the
reference, and seeded draws with the exponential race over the reference distribution.
"""

import math

import pytest
import torch
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.worker.sampler import Sampler, _candidates, _full_sort_probs, _num_candidates

VOCAB = 2048
MARGIN = 2e-6  # rows whose top-p / min-p boundary is this close to the threshold are float-ambiguous


def reference(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, bool]:
    """Kept probabilities over the vocabulary (renormalized), and whether the row is unambiguous (no
    cumulative mass or min_p ratio within MARGIN of its threshold)."""
    x = logits.double() / p.temperature
    vals, idx = x.sort(descending=True, stable=True)
    vocab = x.numel()
    if 0 < p.top_k < vocab:
        vals = torch.where(torch.arange(vocab) < p.top_k, vals, torch.tensor(-math.inf, dtype=vals.dtype))
    probs = vals.softmax(-1)
    clear = True
    if p.top_p < 1.0:
        before = probs.cumsum(-1) - probs
        clear &= bool(((before - p.top_p).abs() > MARGIN).all())
        probs = torch.where(before >= p.top_p, 0.0, probs)
        probs = probs / probs.sum()
    if p.min_p > 0.0:
        ratio = probs / probs.max()
        clear &= bool(((ratio - p.min_p).abs() > MARGIN).all())
        probs = torch.where(ratio < p.min_p, 0.0, probs)
        probs = probs / probs.sum()
    return torch.zeros(vocab, dtype=torch.float64).scatter_(0, idx, probs), clear


def sampler_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's kept probabilities, renormalized, each row from the path the sampler gives it, and
    which rows took the top-K path."""
    n, vocab = logits.shape
    out = torch.zeros(n, vocab, dtype=torch.float64)
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    fast = torch.zeros(n, dtype=torch.bool)
    k = _num_candidates(params, vocab, 1024)
    if k:
        scores, ids, ok = _candidates(logits, temps, params, k)
        scores, ids, fast = torch.from_numpy(scores), torch.from_numpy(ids), torch.from_numpy(ok)
        out[fast] = out[fast].scatter_(1, ids[fast], scores[fast].double())
    slow = ~fast
    if slow.any():
        rows = slow.nonzero().view(-1).tolist()
        out[slow] = _full_sort_probs(logits[slow] / temps[slow], [params[i] for i in rows]).double()
    return out / out.sum(-1, keepdim=True), fast


PARAMS = [
    SamplingParams(temperature=0.2, top_p=0.9),  # the bundled model's defaults
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.7, top_p=0.99),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=200, top_p=0.95),  # K raised to top_k + 1
    SamplingParams(temperature=1.0, top_k=1500, top_p=0.9),  # beyond the K limit: the full sort
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.5, min_p=0.02, top_p=0.95),
    SamplingParams(temperature=0.5, top_k=64),
    SamplingParams(temperature=1.0),  # no truncation at all
]


def random_logits(n: int, seed: int, quantize: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows from peaked to nearly flat: flat rows' nucleus does not fit in the K.
    scale = torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0, 8.0]).repeat(n // 6 + 1)[:n].unsqueeze(1)
    logits = torch.randn(n, VOCAB, generator=g) * scale
    if quantize:
        logits = (logits / quantize).round() * quantize  # many exact ties, as bf16 logits have
    return logits


def check_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    got, fast = sampler_probs(logits, params)
    compared = 0
    for i, p in enumerate(params):
        want, clear = reference(logits[i], p)
        if not clear:
            continue
        compared += 1
        assert torch.equal(got[i] > 0, want > 0), (i, p, (got[i] > 0).sum(), (want > 0).sum())
        torch.testing.assert_close(got[i], want, atol=2e-6, rtol=1e-4)
    assert compared >= len(params) * 0.75, compared
    return fast


@pytest.mark.parametrize("quantize", [0.0, 0.25])
def test_kept_tokens_and_probabilities_match_the_full_sort(quantize: float) -> None:
    for j, p in enumerate(PARAMS):
        n = 36
        fast = check_rows(random_logits(n, seed=j, quantize=quantize), [p] * n)
        if p.top_k == 1500 or (p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0):
            assert not fast.any()


def test_peaked_rows_decided_without_the_normalizer_pass_match_the_full_sort() -> None:
    # Only peaked rows: the normalizer's bounds from the K alone settle every row (no pass over the
    # vocabulary), including rows whose nucleus has many tokens.
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(48, VOCAB, generator=g) * 6.0
    logits[::3, :40] += 30.0  # forty near-equal top tokens far above the rest: a wide nucleus
    for p in (SamplingParams(temperature=0.2, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01)):
        assert check_rows(logits, [p] * 48).all()


def test_mixed_batch_takes_both_paths_and_matches() -> None:
    n = 6 * len(PARAMS)
    params = [PARAMS[i % len(PARAMS)] for i in range(n)]
    for quantize in (0.0, 0.5):
        fast = check_rows(random_logits(n, seed=100, quantize=quantize), params)
        assert 0 < int(fast.sum()) < n  # the comparison covers both paths


def test_a_tie_across_the_k_boundary_takes_the_full_sort_and_keeps_the_lowest_ids() -> None:
    # One top token, then 200 tokens tied below it: top_k=3 keeps the top token and the two lowest-id
    # tied tokens; top_p half a tied token above the top token's mass keeps one tied token, the lowest id.
    logits = torch.full((2, VOCAB), -30.0)
    tied = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:201]
    logits[:, tied[0]] = 5.0
    logits[:, tied[1:]] = 0.0
    lowest = tied[1:].sort().values
    z = math.exp(5.0) + 200 + (VOCAB - 201) * math.exp(-30.0)
    top_p = (math.exp(5.0) + 0.5) / z  # the top token's mass plus half a tied token's
    for p, want in ((SamplingParams(top_k=3), lowest[:2]), (SamplingParams(top_p=top_p), lowest[:1])):
        got, _ = sampler_probs(logits, [p, p])
        kept = set((got[0] > 0).nonzero().view(-1).tolist())
        assert kept == {int(tied[0])} | set(want.tolist()), (p, kept)


def make_reqs(params: list[SamplingParams], seeds: list[int | None]) -> list[Request]:
    reqs = []
    for i, (p, s) in enumerate(zip(params, seeds, strict=True)):
        r = Request("r", i, [0], 1, p, arrival_time=0.0)
        if s is not None:
            r.generator = torch.Generator().manual_seed(s)
        reqs.append(r)
    return reqs


def test_seeded_tokens_are_the_exponential_race_over_the_reference_distribution() -> None:
    # Each seeded row draws q ~ Exp(1) for the whole vocabulary from its own generator and takes
    # argmax(p / q): the same token whichever path the row takes, step after step.
    n = 4 * len(PARAMS)
    params = [PARAMS[i % len(PARAMS)] for i in range(n)]
    logits = random_logits(n, seed=7)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    reqs = make_reqs(params, list(range(n)))
    gens = [torch.Generator().manual_seed(s) for s in range(n)]
    for _step in range(3):
        tokens, _ = sampler(logits.clone(), reqs)
        want = []
        for i, p in enumerate(params):
            q = torch.empty(VOCAB).exponential_(generator=gens[i])
            want.append(int((reference(logits[i], p)[0] / q.double()).argmax()))
        assert tokens == want


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9)
    logits = random_logits(12, seed=3)
    alone = [Sampler(VOCAB, torch.device("cpu"))(logits[i : i + 1].clone(), make_reqs([p], [40 + i]))[0][0]
             for i in range(12)]
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), p]
    mixed_params = [others[i % 3] if i % 2 else p for i in range(12)]
    seeds = [40 + i if i % 2 == 0 else None for i in range(12)]
    mixed, _ = Sampler(VOCAB, torch.device("cpu"))(logits.clone(), make_reqs(mixed_params, seeds))
    assert [mixed[i] for i in range(0, 12, 2)] == alone[::2]


def test_unseeded_draws_follow_the_kept_distribution() -> None:
    # The top-K path's race over the K alone: frequencies of 20,000 draws within 5 standard deviations.
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.full((VOCAB,), -40.0)
    logits[:6] = probs.log()
    p = SamplingParams(temperature=1.0, top_p=0.85)  # keeps the first four: 0.4+0.25+0.15 < 0.85
    draws = 20000
    assert _candidates(logits.expand(1, VOCAB), 1.0, [p], 64)[2].all()  # the top-K path
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(logits.expand(draws, VOCAB).clone(), make_reqs([p] * draws,
                                                                                                  [None] * draws))
    kept = probs[:4] / probs[:4].sum()
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert int(counts[4:].sum()) == 0
    for t in range(4):
        sd = math.sqrt(kept[t] * (1 - kept[t]) / draws)
        assert abs(counts[t] / draws - kept[t]) < 5 * sd, counts[:6]


def test_greedy_rows_are_the_argmax_in_a_mixed_batch() -> None:
    logits = random_logits(12, seed=5, quantize=0.5)  # ties: argmax is the first maximum
    params = [SamplingParams(temperature=0.0) if i % 3 else SamplingParams(temperature=0.2, top_p=0.9)
              for i in range(12)]
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(logits.clone(), make_reqs(params, [None] * 12))
    for i in range(1, 12, 3):
        assert tokens[i] == int(logits[i].argmax())
        assert logits[i, tokens[i]] == logits[i].max() and (logits[i, : tokens[i]] < logits[i].max()).all()


@pytest.mark.parametrize("temps", [[1, 1, 1], [1, 2, 1]])
def test_integer_temperatures_sample_only_kept_tokens(temps: list[int]) -> None:
    # JSON's `"temperature": 1` arrives as an int: the same-temperature batch and a mixed one both work
    # and keep top_p's nucleus: the first two tokens here (0.6 + 0.3 at T=1, 0.47 + 0.33 at T=2 reach 0.75).
    logits = torch.full((VOCAB,), -40.0)
    logits[:3] = torch.tensor([0.6, 0.3, 0.1]).log()
    params = [SamplingParams(temperature=t, top_p=0.75) for t in temps]
    draws = 200
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(
        logits.expand(draws * len(params), VOCAB).clone(), make_reqs(params * draws, [None] * draws * len(params))
    )
    assert set(tokens) <= {0, 1} and len(set(tokens)) == 2


def test_unseeded_full_vocabulary_draws_follow_the_distribution() -> None:
    # No truncation at all (temperature only): the row takes the full-vocabulary path, drawn by inverting
    # its CDF. Frequencies of 20,000 draws within 5 standard deviations of the softmax.
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.full((VOCAB,), -40.0)
    logits[:6] = probs.log()
    p = SamplingParams(temperature=1.0)
    assert _num_candidates([p], VOCAB, 1024) == 0  # no top-K path for this row
    draws = 20000
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(logits.expand(draws, VOCAB).clone(),
                                                    make_reqs([p] * draws, [None] * draws))
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert int(counts[6:].sum()) == 0  # 2,042 tokens of mass e^-40 each: ~1e-14 in all
    for t in range(6):
        sd = math.sqrt(probs[t] * (1 - probs[t]) / draws)
        assert abs(counts[t] / draws - probs[t]) < 5 * sd, counts[:6]


def test_unseeded_full_sort_draws_never_take_a_dropped_token() -> None:
    # 100 tied tokens and top_p 0.5: the kept 50 (lowest ids) tie with tokens outside the K, so the row
    # takes the full sort; every draw is one of the 50 and each comes up about equally often.
    logits = torch.full((VOCAB,), float("-inf"))
    logits[:100] = 0.0
    p = SamplingParams(temperature=1.0, top_p=0.5)
    assert not _candidates(logits.unsqueeze(0), 1.0, [p], 64)[2].any()
    draws = 10000
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(logits.expand(draws, VOCAB).clone(),
                                                    make_reqs([p] * draws, [None] * draws))
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert int(counts[50:].sum()) == 0, counts[45:55]
    sd = math.sqrt(0.02 * 0.98 / draws)
    assert ((counts[:50] / draws - 0.02).abs() < 5 * sd).all(), counts[:50]


def test_a_uniform_draw_at_the_total_takes_the_last_kept_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # u = rand * total can round up to the total itself; no CDF entry passes it, and the draw must not
    # land on the dropped tokens after the last kept one.
    probs = torch.zeros(2, VOCAB)
    probs[0, [3, 17, 40]] = torch.tensor([0.5, 0.3, 0.2])
    probs[1, [0, 1]] = torch.tensor([0.9, 0.1])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(*a, dtype=k.get("dtype")))
    picked = Sampler(VOCAB, torch.device("cpu"))._draw_full(probs, make_reqs([SamplingParams()] * 2, [None, None]))
    assert picked.tolist() == [40, 1]
