"""Each penalty and min_p changes the logits as defined (vLLM's / OpenAI's definitions, written out below
as the reference), checked through the Sampler's public call only.

Penalties: greedy picks between a penalized token and a rival whose logit is set just below, then just
above, the reference's penalized value; the choice flips exactly there, which pins the penalized logit
to within EPS. min_p: thousands of seeded draws from one distribution never return a token under the
threshold and return the kept ones in their renormalized proportions.
"""

import math

import pytest
import torch
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.worker.sampler import Sampler

VOCAB = 8
EPS = 1e-3
TARGET, RIVAL = 3, 5  # the penalized token and the untouched token it competes with


def reference_penalized(logit: float, in_prompt: bool, output_count: int, p: SamplingParams) -> float:
    """The definitions: repetition_penalty divides a positive logit (multiplies a negative one) of any
    token seen in the prompt or the output; frequency_penalty subtracts penalty x times generated;
    presence_penalty subtracts penalty once if generated at all (both count the output only)."""
    if (in_prompt or output_count > 0) and p.repetition_penalty != 1.0:
        logit = logit / p.repetition_penalty if logit > 0 else logit * p.repetition_penalty
    logit -= p.frequency_penalty * output_count
    if output_count > 0:
        logit -= p.presence_penalty
    return logit


def make_request(params: SamplingParams, in_prompt: bool, output_count: int) -> Request:
    prompt = [0, 1] + ([TARGET] if in_prompt else [])
    output = [6] + [TARGET] * output_count
    return Request("r", 0, prompt + output, len(prompt), params, arrival_time=0.0)


CASES = [
    # (params, target logit, in prompt, times generated)
    (SamplingParams(temperature=0.0, repetition_penalty=1.3), 2.0, True, 0),
    (SamplingParams(temperature=0.0, repetition_penalty=1.3), -1.5, False, 2),
    (SamplingParams(temperature=0.0, repetition_penalty=0.7), 1.0, True, 1),  # < 1 rewards repeats
    (SamplingParams(temperature=0.0, frequency_penalty=0.4), 3.0, False, 3),
    (SamplingParams(temperature=0.0, frequency_penalty=-0.5), 0.5, False, 2),
    (SamplingParams(temperature=0.0, frequency_penalty=1.5), 2.0, True, 0),  # prompt-only: untouched
    (SamplingParams(temperature=0.0, presence_penalty=0.8), 3.0, False, 4),  # once, whatever the count
    (SamplingParams(temperature=0.0, presence_penalty=1.2), 2.0, True, 0),  # prompt-only: untouched
    (SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.5),
     2.5, True, 2),  # all three: repetition first, then the subtractions
]


@pytest.mark.parametrize("params,logit,in_prompt,count", CASES)
def test_penalized_logit_is_the_defined_value(params, logit, in_prompt, count) -> None:
    expected = reference_penalized(logit, in_prompt, count, params)
    rows, reqs = [], []
    for rival in (expected - EPS, expected + EPS):
        row = torch.full((VOCAB,), -20.0)
        row[TARGET], row[RIVAL] = logit, rival
        rows.append(row)
        reqs.append(make_request(params, in_prompt, count))
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(torch.stack(rows), reqs)
    assert tokens == [TARGET, RIVAL], (expected, tokens)


def test_no_penalty_leaves_repeated_tokens_alone() -> None:
    params = SamplingParams(temperature=0.0)
    rows = [torch.full((VOCAB,), -20.0) for _ in range(2)]
    for row, rival in zip(rows, (2.0 - EPS, 2.0 + EPS), strict=True):
        row[TARGET], row[RIVAL] = 2.0, rival
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(torch.stack(rows), [make_request(params, True, 3)] * 2)
    assert tokens == [TARGET, RIVAL]


def test_min_p_drops_tokens_below_the_threshold_and_keeps_the_rest_in_proportion() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.5 keeps p >= 0.25 (tokens 0 and 1) only.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0])
    logits = torch.log(probs.clamp_min(1e-30))
    draws = 4000
    reqs = []
    for seed in range(draws):
        r = Request("m", seed, [0], 1, SamplingParams(temperature=1.0, min_p=0.5, seed=seed), arrival_time=0.0)
        r.generator = torch.Generator().manual_seed(seed)
        reqs.append(r)
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(logits.expand(draws, VOCAB).clone(), reqs)
    counts = [tokens.count(t) for t in range(VOCAB)]
    assert counts[2] == counts[3] == 0 and sum(counts) == draws, counts
    # Renormalized over the kept tokens: 0.5 / 0.8 = 0.625 for token 0; allow 5 standard deviations.
    share, sd = counts[0] / draws, math.sqrt(0.625 * 0.375 / draws)
    assert abs(share - 0.625) < 5 * sd, counts


def test_min_p_zero_keeps_every_token() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0])
    logits = torch.log(probs.clamp_min(1e-30))
    draws = 4000
    reqs = []
    for seed in range(draws):
        r = Request("m", seed, [0], 1, SamplingParams(temperature=1.0, seed=seed), arrival_time=0.0)
        r.generator = torch.Generator().manual_seed(seed)
        reqs.append(r)
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(logits.expand(draws, VOCAB).clone(), reqs)
    assert tokens.count(3) > 0  # p = 0.05: about 200 of 4000


def test_a_tiny_positive_temperature_samples_the_top_token() -> None:
    # Found while fuzzing a real server: logits / 1e-300 overflowed to inf, softmax gave NaN, and token 0 came out.
    temps = [1e-300, 1e-40, 1e-20, 1e-5]
    row = torch.zeros(VOCAB)
    row[TARGET] = 5.0  # far above the rest: any temperature this small must pick it
    reqs = []
    for i, t in enumerate(temps):
        r = Request("t", i, [0], 1, SamplingParams(temperature=t, seed=i), arrival_time=0.0)
        r.generator = torch.Generator().manual_seed(i)
        reqs.append(r)
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(row.expand(len(temps), VOCAB).clone(), reqs)
    assert tokens == [TARGET] * len(temps)
