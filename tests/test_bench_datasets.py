"""Workload parsing and generators for the benchmarks."""

import json
import random

import pytest
from tokenmill.engine.bench.datasets import (
    BenchRequest,
    load_requests,
    parse_jsonl,
    random_requests,
    seed_sim_requests,
    subsample,
    tokenize_requests,
)
from tokenmill.engine.bench.throughput import (
    ideal_continuous_steps,
    sequential_steps,
    static_batching_steps,
    workload_step_counts,
)


def test_seed_sim_output_lengths_are_the_seeds_draws():
    random.seed(7)
    expected = [min(1000, int(random.lognormvariate(4.6, 0.8))) for _ in range(200)]
    reqs = load_requests("seed-sim")
    assert [r.max_tokens for r in reqs] == expected
    assert all(8 <= r.prompt_len <= 32 for r in reqs)


def test_seed_sim_n_continues_the_seeds_stream():
    random.seed(7)
    expected = [min(1000, int(random.lognormvariate(4.6, 0.8))) for _ in range(1000)]
    reqs = load_requests("seed-sim:1000")
    assert [r.max_tokens for r in reqs] == expected
    base = load_requests("seed-sim")
    assert [r.prompt_token_ids for r in reqs[:200]] == [r.prompt_token_ids for r in base]
    assert all(8 <= r.prompt_len <= 32 for r in reqs)
    for bad in ("seed-sim:", "seed-sim:0", "seed-sim:ten"):
        with pytest.raises(ValueError, match="seed-sim:N needs a request count N >= 1"):
            load_requests(bad)


def test_seed_sim_reproduces_the_seeds_step_counts():
    # The anchors: one at a time 25,505 steps, static batches of 8 8,020, continuous 3,319.
    lens = [r.max_tokens for r in seed_sim_requests()]
    assert workload_step_counts(lens, 8) == {
        "sequential": 25505,
        "static_batching": 8020,
        "ideal_continuous_batching": 3319,
    }


def test_step_counts_on_a_hand_worked_workload():
    lens = [3, 1, 4, 1, 5]
    assert sequential_steps(lens) == 14
    assert static_batching_steps(lens, 2) == 3 + 4 + 5
    # slots: A runs 3 (0-3), B runs 1 (0-1) then 4 (1-5); A takes 1 (3-4) then 5 (4-9)
    assert ideal_continuous_steps(lens, 2) == 9
    assert ideal_continuous_steps(lens, 10) == 5
    assert ideal_continuous_steps([], 8) == 0


def test_random_spec_follows_nano_vllm_shape():
    reqs = load_requests("random:50:300:200", seed=3)
    assert len(reqs) == 50
    assert all(100 <= r.prompt_len <= 300 for r in reqs)
    assert all(100 <= r.max_tokens <= 200 for r in reqs)
    assert all(0 <= t <= 10000 for r in reqs for t in r.prompt_token_ids)
    assert len({r.prompt_len for r in reqs}) > 10  # lengths actually vary
    again = load_requests("random:50:300:200", seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = load_requests("random:50:300:200", seed=4)
    assert [r.max_tokens for r in other] != [r.max_tokens for r in reqs]


def test_random_spec_below_100_is_exact():
    reqs = random_requests(3, 16, 8)
    assert [r.prompt_len for r in reqs] == [16, 16, 16]
    assert [r.max_tokens for r in reqs] == [8, 8, 8]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("random:3:4", "random:N:IN:OUT"),
        ("random:0:4:4", "at least 1"),
        ("random:x:4:4", "integers"),
        ("no-such-file.jsonl", "is not a file"),
    ],
)
def test_bad_dataset_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        load_requests(spec)


def test_jsonl_accepts_text_and_token_prompts(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        json.dumps({"prompt": "Hello there", "max_tokens": 5}) + "\n\n"
        + json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n"
    )
    reqs = load_requests(str(path))
    assert reqs == [BenchRequest(5, "Hello there", None), BenchRequest(2, None, [1, 2, 3])]
    assert reqs[1].prompt_len == 3
    with pytest.raises(ValueError, match="tokenize"):
        _ = reqs[0].prompt_len


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x"}', "max_tokens must be an integer >= 1, got None"),
        ('{"prompt": "x", "max_tokens": 0}', "got 0"),
        ('{"prompt": "x", "max_tokens": true}', "got True"),
        ('{"prompt": "x", "prompt_token_ids": [1], "max_tokens": 3}', "exactly one"),
        ('{"max_tokens": 3}', "exactly one"),
        ('{"prompt": "", "max_tokens": 3}', "non-empty string"),
        ('{"prompt_token_ids": [], "max_tokens": 3}', "non-empty list"),
        ('{"prompt_token_ids": [1, -2], "max_tokens": 3}', "got -2"),
        ('{"prompt_token_ids": [1, "a"], "max_tokens": 3}', "got 'a'"),
        ("[1, 2]", "expected a JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_jsonl_errors_name_the_line(line, message):
    text = json.dumps({"prompt": "fine", "max_tokens": 1}) + "\n" + line + "\n"
    with pytest.raises(ValueError, match=message) as err:
        parse_jsonl(text, source="w.jsonl")
    assert "w.jsonl:2" in str(err.value)


def test_empty_jsonl_is_an_error():
    with pytest.raises(ValueError, match="no requests"):
        parse_jsonl("\n\n", source="empty.jsonl")


def test_subsample_is_evenly_spaced_and_ordered():
    reqs = [BenchRequest(max_tokens=i + 1, prompt_token_ids=[1]) for i in range(200)]
    picked = subsample(reqs, 16)
    idx = [r.max_tokens - 1 for r in picked]
    assert idx == [0, 12, 25, 37, 50, 62, 75, 87, 100, 112, 125, 137, 150, 162, 175, 187]
    assert subsample(reqs, 500) == reqs


def test_tokenize_fills_only_text_prompts():
    calls = []

    def fake_tokenizer(text, add_special_tokens):
        calls.append((text, add_special_tokens))
        return {"input_ids": [len(text), 7]}

    reqs = [BenchRequest(3, "abcd"), BenchRequest(3, None, [9, 9, 9])]
    tokenize_requests(reqs, fake_tokenizer)
    assert [r.prompt_token_ids for r in reqs] == [[4, 7], [9, 9, 9]]
    assert calls == [("abcd", False)]
