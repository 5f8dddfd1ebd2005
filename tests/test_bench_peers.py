"""bench peers' pure part: client JSON -> rows -> ratio table and markdown, against hand-written results
(the figures below are made up; the expected ratios are computed by hand)."""


import math

import pytest
from tokenmill.engine.bench.peers import markdown, plot, ratio_table, row_from_result


def vllm_json(tok_s, tpot, ttft, completed=64, failed=0):
    return {"output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft,
            "completed": completed, "failed": failed}  # fmt: skip


def ours_json(tok_s, tpot, ttft, completed=64, failed=0):
    return {"output_throughput": tok_s, "tpot": {"median_ms": tpot}, "ttft": {"median_ms": ttft},
            "completed": completed, "failed": failed}  # fmt: skip


def rows():
    v, t = "vllm bench serve", "tokenmill bench serve"
    return [
        row_from_result("tokenmill", v, "random 128/128", 64, vllm_json(600.0, 100.0, 900.0)),
        row_from_result("vllm", v, "random 128/128", 64, vllm_json(400.0, 150.0, 800.0)),
        row_from_result("llama.cpp", v, "random 128/128", 64, vllm_json(80.0, 700.0, 5000.0, 49, 15)),
        row_from_result("tokenmill", v, "random 128/128", 1, vllm_json(90.0, 10.0, 20.0)),
        row_from_result("llama.cpp", v, "random 128/128", 1, vllm_json(180.0, 5.0, 15.0)),
        row_from_result("tokenmill", t, "random 128/128", 1, ours_json(88.0, 11.0, 21.0)),
        row_from_result("vllm", t, "random 128/128", 1, ours_json(0.0, float("nan"), float("nan"), 0, 64)),
    ]


def test_rows_read_both_clients_json() -> None:
    r = rows()
    assert (r[0].output_tok_s, r[0].median_tpot_ms, r[0].median_ttft_ms) == (600.0, 100.0, 900.0)
    assert (r[5].output_tok_s, r[5].median_tpot_ms, r[5].median_ttft_ms) == (88.0, 11.0, 21.0)
    assert (r[2].completed, r[2].failed) == (49, 15)
    with pytest.raises(ValueError, match="unknown client"):
        row_from_result("vllm", "curl", "w", 1, {})


def test_ratio_table_by_hand() -> None:
    table = ratio_table(rows())
    assert [(t["client"], t["concurrency"]) for t in table] == [
        ("vllm bench serve", 64), ("vllm bench serve", 1), ("tokenmill bench serve", 1)
    ]
    c64, c1, ours = table
    assert c64["tokenmill/vllm tok/s"] == pytest.approx(1.5)  # 600 / 400
    assert c64["tokenmill/llama.cpp tok/s"] == pytest.approx(7.5)  # 600 / 80
    assert c64["vllm/tokenmill tpot"] == pytest.approx(1.5)  # 150 / 100
    assert c1["tokenmill/llama.cpp tok/s"] == pytest.approx(0.5)  # 90 / 180: llama.cpp twice as fast
    assert "tokenmill/vllm tok/s" not in c1  # vLLM did not run this line
    assert ours["tokenmill/vllm tok/s"] is None and ours["vllm/tokenmill tpot"] is None  # no tokens


def test_markdown_and_plot(tmp_path) -> None:
    text = markdown(ratio_table(rows()))
    lines = text.strip().splitlines()
    assert lines[0].startswith("| model | client | workload | concurrency | tokenmill tok/s (TPOT ms)")
    assert lines[0].endswith("| tokenmill / vllm | tokenmill / llama.cpp |")
    assert "| 80.0 (700.0, 15 failed) |" in lines[2] and lines[2].endswith("| 1.50 | 7.50 |")
    assert lines[3].endswith("| - | 0.50 |")
    assert len(lines) == 2 + 3
    out = tmp_path / "peers.png"
    plot(ratio_table(rows()), str(out), "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_models_get_their_own_lines() -> None:
    """The dense bf16 case beside the bundled model: a ratio is only taken within one model."""
    v = "vllm bench serve"
    table = ratio_table([
        row_from_result("tokenmill", v, "random 128/128", 8, vllm_json(300.0, 20.0, 50.0)),
        row_from_result("vllm", v, "random 128/128", 8, vllm_json(150.0, 40.0, 60.0)),
        row_from_result("tokenmill", v, "random 128/128", 8, vllm_json(90.0, 60.0, 70.0), "dense-bf16"),
        row_from_result("vllm", v, "random 128/128", 8, vllm_json(100.0, 54.0, 80.0), "dense-bf16"),
    ])  # fmt: skip
    assert [t["model"] for t in table] == ["bundled", "dense-bf16"]
    assert table[0]["tokenmill/vllm tok/s"] == pytest.approx(2.0)  # 300 / 150
    assert table[1]["tokenmill/vllm tok/s"] == pytest.approx(0.9)  # 90 / 100
    assert table[1]["vllm/tokenmill tpot"] == pytest.approx(0.9)  # 54 / 60
    lines = markdown(table).strip().splitlines()
    assert lines[3].startswith("| dense-bf16 | vllm bench serve | random 128/128 | 8 | 90.0 (60.0) |")


def test_weights_markdown_by_hand() -> None:
    from tokenmill.engine.bench.peers import WeightsRead, weights_markdown

    w = [WeightsRead("vllm", "dense-bf16", 723_642_240, 361_821_120, "bfloat16"),
         WeightsRead("llama.cpp", "bundled", 85_000_000, 134_515_008, "GGUF Q4_1/Q8_0")]  # fmt: skip
    lines = weights_markdown(w).strip().splitlines()
    assert lines[2] == "| dense-bf16 | vllm | 724 MB | 2.000 | bfloat16 |"
    assert lines[3] == "| bundled | llama.cpp | 85 MB | 0.632 | GGUF Q4_1/Q8_0 |"  # 85e6 / 134,515,008


def test_weights_read_from_the_engines_own_check() -> None:
    """tokenmill's figure comes from the engine's real plan (the count `serve --check` prints and the
    operator sizes with): the bundled GGUF is held as codes where this CPU's kernels run (the probe says),
    else at its dtype's bytes; llama.cpp's from the real GGUF header."""
    from tokenmill.engine.bench.peers import PeerModel, weights_read
    from tokenmill.engine.model.bundled import bundled_gguf_path
    from tokenmill.kernels.cpu_probe import probe

    gguf = str(bundled_gguf_path())
    w = weights_read("tokenmill", PeerModel("bundled", "", gguf, gguf), "")
    assert w is not None and w.parameters > 100_000_000
    if probe().at_least("avx2"):  # codes wherever the CPU kernels run: bf16 from AVX-512 BF16, else fp32
        assert "Q4_1" in w.format and w.bytes_per_weight < 1.0
    else:
        assert w.bytes_per_weight >= 2.0
    llama = weights_read("llama.cpp", PeerModel("bundled", "", gguf, gguf), "")
    assert llama is not None and llama.format.startswith("GGUF") and "Q4_1" in llama.format
    assert llama.parameters == w.parameters and llama.bytes_per_weight < 1.0


def test_a_bf16_checkpoint_is_named_as_tokenmill_holds_it(tmp_path, bundled_model_dir) -> None:
    """Served in fp32 (the default below AVX-512 BF16) with the CPU kernels, a bf16 checkpoint is held as
    bf16 panels: 2 bytes a linear weight, and the table says so rather than "float32"."""
    import torch
    from tokenmill.engine.bench.peers import PeerModel, weights_read
    from tokenmill.kernels.cpu_probe import probe

    from tests.tiny_models import make_tiny_model

    folder = str(make_tiny_model(tmp_path, "llama", tokenizer_dir=bundled_model_dir, dtype=torch.bfloat16))
    w = weights_read("tokenmill", PeerModel("tiny", folder, folder, None), "")
    if probe().at_least("avx512_bf16"):  # served in bf16: the checkpoint's own bytes
        assert w.format == "bfloat16" and w.bytes_per_weight == 2.0
    elif probe().at_least("avx2"):
        # Every matrix a kernel multiplies by at 2 bytes; the untied embedding table (a lookup) and the
        # norms at fp32's 4, counted here from the checkpoint's own tensors.
        from safetensors import safe_open

        with safe_open(f"{folder}/model.safetensors", "pt") as f:
            sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        expected = sum(
            (4 if "embed_tokens" in k or "norm" in k else 2) * math.prod(shape) for k, shape in sizes.items()
        )
        assert w.format == "bf16 panels (float32)" and w.weight_bytes == expected, (w, expected)
    else:
        assert w.format == "float32" and w.bytes_per_weight == 4.0


def test_peak_rss_counts_the_servers_children() -> None:
    """tokenmill's engine core is a child of its API server: the peak looks through the process tree."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tokenmill.engine.bench.peers import peak_rss_bytes

    child = "x = bytearray(80_000_000); x[::4096] = b'1' * len(x[::4096]); import time; time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"],
                              start_new_session=True)  # fmt: skip
    try:
        peak = 0
        for _ in range(100):  # until the child has touched its 80 MB
            time.sleep(0.1)
            peak = peak_rss_bytes(parent.pid)
            if peak > 80_000_000:
                break
        assert peak > 80_000_000
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child
        parent.wait()
