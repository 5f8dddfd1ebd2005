"""Hub models through the real programs: `tokenmill serve --model hf://...` (a real server process, the
official openai client), `tokenmill download`, `tokenmill serve --check`, all against the Hub stand-in
(tests/hub_standin.py) through HF_ENDPOINT, with a fresh HF_HOME; the stand-in counts every request.
The served repo is a tiny Llama stored in fp32 and the same architecture stored in bf16, as Hub repos are."""

import subprocess
import sys

import openai
import pytest
import torch
from conftest_server import REPO, ServerProcess
from hub_standin import HubStandin
from tiny_models import make_tiny_model
from tokenmill.engine.cli import serve as serve_cli

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, bundled_model_dir):
    tiny = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", tokenizer_dir=bundled_model_dir)
    bf16 = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", tokenizer_dir=bundled_model_dir,
                           dtype=torch.bfloat16)
    with HubStandin() as hub:
        hub.sha = hub.add_repo("tiny/llama", tiny, tags=("v1",))
        hub.shas = {"tiny/llama": hub.sha, "tiny/llama-bf16": hub.add_repo("tiny/llama-bf16", bf16, tags=("v1",))}
        hub.add_repo("tiny/gated", tiny, gated=True, tokens=("hf_granted",))
        yield hub


@pytest.fixture
def env(hub, tmp_path) -> dict[str, str]:
    hub.reset_log()
    # The C++ CPU kernels are off: their first build can take minutes on a loaded machine, and these
    # tests are about where the weights come from (the kernels have their own tests).
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_TOKEN": "",
        "TOKENMILL_CPU_KERNELS": "0",
    }


def _tokenmill(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    import os

    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "tokenmill.engine.cli.main", *args]
    return subprocess.run(cmd, env=full, cwd=REPO / "tests", capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("repo", ["tiny/llama", "tiny/llama-bf16"])
def test_serve_downloads_once_and_answers(hub, env, tmp_path, monkeypatch, repo) -> None:
    args = (
        "--model",
        f"hf://{repo}@v1",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "64",
        "--dtype",
        "float32",
    )
    first = ServerProcess(*args, env=env, log_dir=tmp_path)
    gated = ServerProcess("--model", "hf://tiny/gated", env=env, log_dir=tmp_path)  # no token: must exit
    try:
        first.wait_healthy()
        client = openai.OpenAI(
            base_url=f"{first.url}/v1", api_key="none", max_retries=0, timeout=600
        )  # the first step may build the C++ kernels
        assert [m.id for m in client.models.list().data] == [repo]  # the repo id, as vLLM names it
        served = client.completions.create(model=repo, prompt=PROMPT, max_tokens=8, temperature=0)
        assert gated.proc.wait(300) == 1
    finally:
        first.stop()
        gated.stop()
    assert first.proc.returncode == 0, first.log()
    failure = [line for line in gated.log().splitlines() if "startup failed" in line]
    assert len(failure) == 1 and "hf://tiny/gated@main is a gated repo" in failure[0]
    assert "set HF_TOKEN" in failure[0]
    assert hub.downloads(repo, "model.safetensors") == 1
    assert hub.downloads("tiny/gated", "model.safetensors") == 0

    hub.reset_log()
    second = ServerProcess(*args, env=env, log_dir=tmp_path)  # a restart on the same cache
    try:
        second.wait_healthy()
    finally:
        second.stop()
    assert hub.requests() == []  # not one request: the cache holds the snapshot for tag v1

    # The offline API takes the same URI; same cache, same weights, same greedy tokens as the server.
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    llm = LLM(model=f"hf://{repo}@{hub.shas[repo]}", dtype="float32", max_model_len=256, num_kv_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].text == served.choices[0].text
    assert hub.requests() == []


def test_download_shows_progress_and_prints_the_folder(hub, env) -> None:
    done = _tokenmill("download", "tiny/llama", "--revision", "v1", env=env)
    assert done.returncode == 0, done.stderr
    folder = done.stdout.strip().splitlines()[-1]
    assert folder.endswith(f"/models--tiny--llama/snapshots/{hub.sha}") and folder.startswith(env["HF_HOME"])
    assert "100%" in done.stderr  # huggingface_hub's progress bars
    assert hub.downloads("tiny/llama", "model.safetensors") == 1
    missing = _tokenmill("download", "hf://tiny/absent", env=env)
    assert missing.returncode == 1
    assert (
        missing.stderr.strip()
        .splitlines()[-1]
        .startswith("tokenmill download: error: repo tiny/absent not found")
    )


def test_check_accepts_a_good_plan_without_fetching_weights(hub, env) -> None:
    done = _tokenmill(
        "serve", "--check", "--model", "hf://tiny/llama@v1", "--kv-cache-memory", "1GiB", env=env
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("ok: hf://tiny/llama@v1 (LlamaForCausalLM, 2 layers, 4 heads / 2 KV heads)")
    assert [r.filename for r in hub.requests("tiny/llama") if r.method == "GET" and r.filename] == [
        "config.json"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-model-len", "4096"], "max_model_len=4096 is larger than this model supports (512 tokens)"),
        (["--num-kv-blocks", "8"], "needs 32 blocks; raise --num-kv-blocks to at least 32"),
        (["--model", "hf://tiny/absent"], "repo tiny/absent not found"),
        (["--model", "hf://tiny/llama@v7"], "revision 'v7' not found in tiny/llama"),
        (["--model", "hf://tiny/gated"], "is a gated repo"),
    ],
)
def test_check_refuses_what_the_engine_would_refuse(hub, env, monkeypatch, capsys, argv, message) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["--model", "hf://tiny/llama@v1", "--dtype", "float32", *argv]
    assert serve_cli.main(["--check", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tokenmill serve --check: error: ") and message in err[-1]
    assert hub.downloads("tiny/llama", "model.safetensors") == 0


def test_check_refuses_a_bad_uri_at_parse_time(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        serve_cli.main(["--check", "--model", "s3://bucket/model"])
    assert e.value.code == 2 and "unknown scheme s3://" in capsys.readouterr().err
