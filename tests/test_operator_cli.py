import http.server
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
from tokenmill.engine.cli import main as tokenmill
from tokenmill.operator.plan.catalog import GPU_TYPES, MODEL_PROFILES
from tokenmill.operator.plan.sizing import plan

REPO = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable


def size(capsys, *argv) -> tuple[int, str, str]:
    rc = tokenmill(["size", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_size_json_has_the_plan(capsys):
    rc, out, _ = size(capsys, "--model", "Llama-3.1-8B", "--gpu", "nvidia-l4", "--json")
    data = json.loads(out)
    assert rc == 0
    for key in ("weights_bytes", "kv_bytes_per_token", "kv_blocks", "kv_tokens", "max_model_len", "max_num_seqs",
                "gpus_per_replica", "feasible", "reason"):
        assert key in data
    # the numbers of tests/test_operator_sizing.py::test_llama_8b_on_l4_by_hand
    assert (data["weights_bytes"], data["kv_blocks"], data["kv_tokens"], data["max_num_seqs"]) == (16_060_522_496, 977, 15_632, 7)
    assert data == {**plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-l4"]).to_dict(), "profile_source": "catalog"}


def test_size_infeasible_exits_1_with_the_reason(capsys):
    rc, out, _ = size(capsys, "--model", "hf://meta-llama/Llama-3.1-70B-Instruct", "--gpu", "nvidia-l4", "--gpus", "1")
    assert rc == 1
    assert "feasible       no (WeightsDoNotFit)" in out
    assert "needs 141 GB of weights; 1 x nvidia-l4 has 24.2 GB" in out


def test_size_human_output(capsys):
    rc, out, _ = size(capsys, "--model", "bundled://smollm2-135m-instruct", "--gpu", "nvidia-a10g",
                      "--max-model-len", "4096", "--gpu-memory-utilization", "0.5")
    assert rc == 0
    assert "max_model_len  4096 (model supports 8192)" in out
    assert "gpu_memory_utilization 0.5" in out


def test_size_from_config_json(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                               "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                               "vocab_size": 128256, "max_position_embeddings": 131072}))
    rc, out, _ = size(capsys, "--model-config", str(cfg), "--gpu", "nvidia-h100-80gb", "--json")
    data = json.loads(out)
    assert rc == 0 and data["weights_bytes"] == 2 * 8_030_261_248 and data["profile_source"] == "config.json"


def test_size_from_profile_file(capsys, tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("name: tiny\nlayers: 30\nhiddenSize: 576\nnumAttentionHeads: 9\nnumKeyValueHeads: 3\n"
                 "intermediateSize: 1536\nvocabSize: 49152\nmaxPositionEmbeddings: 8192\ntieWordEmbeddings: true\n")
    rc, out, _ = size(capsys, "--profile", str(f), "--gpu", "nvidia-l4", "--json")
    data = json.loads(out)
    assert rc == 0 and data["model"] == "tiny" and data["kv_bytes_per_token"] == 23040


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "gpt-5", "--gpu", "nvidia-l4"], "not in the catalog"),
    (["--model", "Llama-3.1-8B", "--gpu", "nvidia-l4", "--max-model-len", "long"], "--max-model-len must be an integer"),
    (["--model", "Llama-3.1-8B", "--gpu", "nvidia-l4", "--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--profile", "/nonexistent.yaml", "--gpu", "nvidia-l4"], "No such file"),
])
def test_size_bad_input(capsys, argv, message):
    rc, _, err = size(capsys, *argv)
    assert rc == 2 and message in err


def test_size_unknown_gpu_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        tokenmill(["size", "--model", "Llama-3.1-8B", "--gpu", "nvidia-t4"])
    assert e.value.code == 2
    assert "invalid choice: 'nvidia-t4'" in capsys.readouterr().err


def test_operator_cli_checks_its_arguments(capsys):
    assert tokenmill(["operator", "--kubeconfig", "/nonexistent/kubeconfig"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert tokenmill(["operator", "--interval", "0"]) == 2
    with pytest.raises(SystemExit) as e:
        tokenmill(["operator", "--help"])
    assert e.value.code == 0
    assert "--peering" in capsys.readouterr().out


def test_operator_image_needs_no_torch():
    code = ("import sys, tokenmill.operator, tokenmill.operator.cli.size, tokenmill.operator.cli.run, "
            "tokenmill.operator.handlers, tokenmill.operator.reconcile\n"
            "bad = [m for m in ('torch', 'triton', 'transformers', 'fastapi') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([PY, "-c", code], check=True, cwd=REPO, timeout=120)
    bare = subprocess.run([PY, "-c", "import sys, tokenmill.operator, tokenmill.operator.plan.sizing; "
                                     "print(sorted(m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules))"],
                          check=True, cwd=REPO, timeout=120, capture_output=True, text=True)
    assert bare.stdout.strip() == "[]"  # sizing alone pulls in neither Kopf nor the Kubernetes client


class _NoCRD(http.server.BaseHTTPRequestHandler):
    """An API server without our CRD: discovery of serving.tokenmill.dev answers 404."""

    def do_GET(self):
        if self.path.startswith("/apis/serving.tokenmill.dev"):
            code, body = 404, {"kind": "Status", "code": 404, "message": "the server could not find the requested resource"}
        elif self.path == "/api":
            code, body = 200, {"kind": "APIVersions", "versions": ["v1"]}
        elif self.path == "/apis":
            code, body = 200, {"kind": "APIGroupList", "groups": []}
        elif self.path.startswith("/api/v1"):
            code, body = 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": []}
        else:
            code, body = 404, {"kind": "Status", "code": 404}
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass


def test_operator_process_refuses_to_start_without_the_crd(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoCRD)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        kc = tmp_path / "kubeconfig"
        kc.write_text(f"apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:"
                      f"{server.server_address[1]}'}}}}]\nusers: [{{name: u, user: {{token: t}}}}]\n"
                      "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n")
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        proc = subprocess.run([PY, "-m", "tokenmill.engine.cli", "operator", "--kubeconfig", str(kc), "-n", "team-a"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert proc.returncode == 1
    assert "inferenceservices.serving.tokenmill.dev (v1alpha1) is not installed" in proc.stderr
