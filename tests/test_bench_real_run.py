"""Tiny real runs of `tokenmill bench throughput` and `bench compare` on the bundled model."""

import json

import pytest
import torch
from tokenmill.engine.cli.bench import main
from tokenmill.engine.model.resolve import resolve_model

# Output lengths 3, 7, 2, 5, 4. By hand, with 2 slots: static batches [3,7] [2,5] [4] run 7 + 5 + 4 = 16
# steps; continuous batching (a slot refills the step after it frees) runs A: 3, 2, 5 (10 steps) and
# B: 7, 4 (11 steps), so 11.
LENGTHS = [3, 7, 2, 5, 4]
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.jsonl"
    lines = [{"prompt": TEXT, "max_tokens": LENGTHS[0]}]
    lines += [{"prompt_token_ids": list(range(100 + i, 120 + 3 * i)), "max_tokens": n}
              for i, n in enumerate(LENGTHS[1:], start=1)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path, lines


def _expected_prompt_tokens(lines):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    text_len = len(tok(TEXT, add_special_tokens=False)["input_ids"])
    return text_len + sum(len(x["prompt_token_ids"]) for x in lines[1:])


def test_bench_throughput_reports_the_run(dataset, tmp_path, capsys):
    torch.set_num_threads(1)
    path, lines = dataset
    out = tmp_path / "t.json"
    rc = main(["throughput", "--dataset", str(path), "--max-num-seqs", "2", "--threads", "1",
               "--static-batching", "--no-progress", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r  # the same JSON is printed
    for key in ("requests", "prompt_tokens", "generated_tokens", "seconds", "tokens_per_s", "num_steps",
                "mean_tokens_per_step", "slot_occupancy", "kv_utilization", "dtype", "max_num_seqs"):
        assert key in r
    assert r["requests"] == 5 and r["max_num_seqs"] == 2
    assert r["generated_tokens"] == sum(LENGTHS)
    assert r["prompt_tokens"] == _expected_prompt_tokens(lines)
    assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["seconds"])
    # CPU time is only bounded below: tokenizer and helper threads may run beside the one torch thread.
    assert r["cpu_seconds"] > 0
    # Two slots: no fewer steps than the ideal schedule, no more than one request at a time plus prefills.
    assert 11 <= r["num_steps"] <= sum(LENGTHS) + len(LENGTHS)
    assert r["mean_tokens_per_step"] == pytest.approx(sum(LENGTHS) / r["num_steps"])
    assert 0.5 < r["slot_occupancy"] <= 1.0
    assert 0.0 < r["kv_utilization"] <= 1.0
    assert r["dtype"] in ("float32", "bfloat16", "float16")
    assert r["workload_step_counts"] == {"sequential": 21, "static_batching": 16, "ideal_continuous_batching": 11}
    static = r["static_batching"]
    assert static["generated_tokens"] == sum(LENGTHS)
    assert static["num_steps"] >= 16  # each batch runs to its longest member


def test_bench_compare_runs_all_four_systems(dataset, tmp_path):
    torch.set_num_threads(1)
    path, _ = dataset
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    rc = main(["compare", "--dataset", str(path), "--max-num-seqs", "2", "--threads", "1", "--static-batch", "2",
               "--naive-requests", "2", "--static-requests", "4", "--hf-cb-requests", "5",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    rows = {row["system"].split(" (")[0].split(" batches")[0]: row for row in r["rows"]}
    assert set(rows) == {"hf naive", "hf static", "hf continuous batching", "tokenmill"}
    assert rows["hf naive"]["requests"] == 2 and rows["hf naive"]["subset"] is True
    assert rows["hf naive"]["generated_tokens"] == 3 + 2  # requests 0 and 2 (evenly spaced)
    assert rows["hf naive"]["ratio_to_naive"] == pytest.approx(1.0)
    assert rows["hf static"]["generated_tokens"] == 3 + 7 + 2 + 5  # 4 of 5 at stride 1.25: 0, 1, 2, 3
    assert rows["tokenmill"]["requests"] == 5 and rows["tokenmill"]["subset"] is False
    assert rows["tokenmill"]["generated_tokens"] == sum(LENGTHS)
    for row in r["rows"]:
        assert row["median_completion_s"] <= row["p95_completion_s"] <= row["seconds"] + 1e-6
    assert r["tokenmill_vs_naive"] == pytest.approx(
        rows["tokenmill"]["tokens_per_s"] / rows["hf naive"]["tokens_per_s"])
    for row in r["rows"]:  # CPU time has no upper bound: helper threads may run beside the torch thread
        assert row["cpu_seconds"] > 0
        assert row["tokens_per_cpu_s"] == pytest.approx(row["generated_tokens"] / row["cpu_seconds"])
    assert any("hf naive" in s for s in r["subsets"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
