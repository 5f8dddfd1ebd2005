"""`tokenmill bench structured` runs end to end (on a tiny random model) and refuses bad arguments."""

import json

from tokenmill.engine.cli.bench import main

from tests.tiny_models import make_tiny_model


def test_structured_bench_rows_on_a_tiny_model(tmp_path, bundled_model_dir):
    model = make_tiny_model(tmp_path, "llama", tokenizer_dir=bundled_model_dir)
    out = tmp_path / "structured.json"
    rc = main(["structured", "--model", str(model), "--dtype", "float32", "--batches", "1,3", "--max-tokens", "6",
               "--schema-properties", "20", "--num-kv-blocks", "32", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    # Every request generated all its tokens in both runs (the bench checks it; a short row would raise).
    assert [r["tokens_each"] for r in report["rows"]] == [6, 18]
    assert all(r["slowdown"] > 0 for r in report["rows"])
    assert report["large_schema"]["num_properties"] == 20
    assert report["large_schema"]["compile_seconds"] > 0
    stall = report["compile_stall"]
    assert stall["num_properties"] == 20 and stall["compile_wait_seconds"] is not None
    assert stall["median_step_seconds_after"] > 0


def test_structured_bench_refuses_bad_batches(capsys):
    assert main(["structured", "--batches", "0,4"]) == 2
    assert "--batches must list positive batch sizes" in capsys.readouterr().err
