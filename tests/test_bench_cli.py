"""`tokenmill bench` rejects bad input with exit code 2 and a message naming the problem."""

import pytest
from tokenmill.engine.cli.bench import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--base-url", "http://127.0.0.1:9", "--dataset", "seed-sim", "--slo", "ttft:-1"], "> 0 ms"),
        (["serve", "--base-url", "http://127.0.0.1:9", "--dataset", "random:1:2"], "random:N:IN:OUT"),
        (["serve", "--base-url", "http://127.0.0.1:9", "--dataset", "seed-sim", "--max-concurrency", "0"],
         "--max-concurrency must be at least 1, got 0"),
        (["serve", "--base-url", "http://127.0.0.1:9", "--dataset", "seed-sim", "--request-rate", "0"],
         "request rate must be > 0"),
        (["compare", "--dataset", "seed-sim", "--skip", "naive,bogus"], "unknown baseline(s) ['bogus']"),
        (["compare", "--dataset", "seed-sim", "--static-batch", "0"], "--static-batch must be at least 1, got 0"),
        (["throughput", "--dataset", "nope.jsonl"], "'nope.jsonl' is not a file"),
        (["throughput", "--dataset", "seed-sim", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["peers", "--workloads", "random,bogus"], "--workloads takes a comma list of random, prefix"),
        (["peers", "--clients", "curl"], "--clients takes a comma list of vllm, tokenmill"),
        (["peers", "--models", "/nonexistent/model.bin"], "--models /nonexistent/model.bin: not bundled, dense-bf16"),
        (["attention", "--layers", "0"], "--layers must be at least 1, got 0"),
    ],
)
def test_bad_input_exits_2_with_a_named_problem(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert f"tokenmill bench {argv[0]}:" in err


def test_unreachable_server_is_a_failed_run_not_a_crash(capsys):
    # Port 9 (discard) has no HTTP server here: every request fails and the exit code says so.
    rc = main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--dataset", "random:2:4:4",
               "--no-progress", "--timeout", "5"])
    assert rc == 1
    assert '"failed": 2' in capsys.readouterr().out


def test_unreachable_server_without_model_name_says_so(capsys):
    rc = main(["serve", "--base-url", "http://127.0.0.1:9", "--dataset", "random:2:4:4", "--no-progress"])
    assert rc == 1
    assert "cannot list models at http://127.0.0.1:9" in capsys.readouterr().err
