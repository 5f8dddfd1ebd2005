"""Every argument the operator writes is one the engine accepts: for each InferenceService in examples/,
the operator's reconcile builds the engine pod, and the real `tokenmill serve --check` runs with the
pod's own command, arguments and environment (engine/core/preflight.py: model source, architecture,
max_model_len, the KV pool from --kv-cache-memory). hf:// models come from the Hub stand-in through
the HF_ENDPOINT the operator passes on.

What differs from the pod, and only this: HOME, XDG_CACHE_HOME and HF_HOME point at this machine's
folders instead of the pod's volumes (/cache, /model-cache), and Secret values are placeholders.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml
from hub_standin import HubStandin
from test_operator_reconcile import NS
from test_operator_router_reconcile import POOL_API, ServedApi
from tokenmill.operator import reconcile as rec
from tokenmill.operator.observe.hub import HubCache

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
POD_PATHS = ("HOME", "XDG_CACHE_HOME", "HF_HOME")
HUB_REPO_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def example_services() -> list[tuple[str, dict]]:
    out = []
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                out.append((path.name, doc))
    return out


@pytest.fixture(scope="module")
def hub(bundled_model_dir, tmp_path_factory):
    """The Hub stand-in with every hf:// repo the examples name, from the bundled model's files (config
    and tokenizer: --check reads config.json only, and the catalog sizes these models)."""
    folder = tmp_path_factory.mktemp("repo")
    for name in HUB_REPO_FILES:
        if (bundled_model_dir / name).is_file():
            shutil.copy(bundled_model_dir / name, folder / name)
    with HubStandin() as hub:
        for _, doc in example_services():
            uri = doc["spec"]["model"]["uri"]
            if uri.startswith("hf://"):
                repo, _, revision = uri.removeprefix("hf://").partition("@")
                tags = (revision,) if revision and revision != "main" else ()
                hub.add_repo(repo, folder, tags=tags)
        yield hub


def engine_container(doc: dict, hub_url: str, tmp_path: pathlib.Path, status: dict | None = None) -> dict | None:
    """The engine container the operator's reconcile writes for this manifest (None: it creates none);
    `status` gets the status the reconcile wrote."""
    api = ServedApi(POOL_API)  # routed examples need the InferencePool API
    body = {**doc, "metadata": {**doc["metadata"], "namespace": NS, "uid": "uid-1", "generation": 1}}
    for ref in (doc["spec"].get("apiKeySecretRef"), doc["spec"]["model"].get("tokenSecretRef")):
        if ref:
            api.secrets[ref["name"]] = {ref.get("key", "api-key")}
    api.objects[("InferenceService", NS, body["metadata"]["name"])] = body
    config = rec.OperatorConfig(hf_endpoint=hub_url, hub=HubCache(cache_dir=str(tmp_path / "operator-hub")))
    rec.reconcile(api, body, config, autoscale=False, now=1_000_000.0)
    if status is not None:
        status.update(api.objects[("InferenceService", NS, body["metadata"]["name"])].get("status") or {})
    dep = api.objects.get(("Deployment", NS, body["metadata"]["name"]))
    return None if dep is None else dep["spec"]["template"]["spec"]["containers"][0]


def pod_env(container: dict, tmp_path: pathlib.Path) -> dict[str, str]:
    """The container's environment with the deviations listed in the module docstring."""
    env = {e["name"]: e["value"] if "value" in e else "placeholder-secret-value" for e in container["env"]}
    for name in POD_PATHS:
        env.pop(name, None)
    env["HF_HOME"] = str(tmp_path / "hf")
    return env


def run_check_process(container: dict, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    """`tokenmill serve ARGS --check` as its own process, as the pod would start it."""
    env = {**os.environ, **pod_env(container, tmp_path)}
    binary = pathlib.Path(sys.executable).parent / container["command"][0]
    argv = [str(binary), *container["command"][1:], *container["args"], "--check"]
    # cwd outside the repository: its operator/ folder would shadow the stdlib module (see COMMON.md).
    return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def run_check(container: dict, tmp_path: pathlib.Path, monkeypatch, capsys, args: list[str] | None = None):
    """The same check in this process (what `tokenmill serve` calls), to spare a torch import per case."""
    from tokenmill.engine.cli import serve as serve_cli

    for name, value in pod_env(container, tmp_path).items():
        monkeypatch.setenv(name, value)
    assert container["command"] == ["tokenmill", "serve"]
    rc = serve_cli.main([*(container["args"] if args is None else args), "--check"])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize(("name", "doc"), example_services(), ids=[n for n, _ in example_services()])
def test_every_example_argv_passes_the_engines_own_check(hub, tmp_path, monkeypatch, capsys, name, doc):
    status: dict = {}
    container = engine_container(doc, hub.url, tmp_path, status)
    if container is None:
        assert name == "infeasible-model.yaml", f"{name}: the operator created no Deployment"
        return  # no pod, so no argument to check
    hub.reset_log()
    rc, out = run_check(container, tmp_path, monkeypatch, capsys)
    assert rc == 0 and out.startswith("ok: "), f"{name}: {container['args']}\n{out}"
    # The engine counts the KV bytes the operator counted (kv_memory for both): the cache dtype, the bytes
    # per token of each rank, and so the blocks that --kv-cache-memory buys.
    sizing = status["sizing"]
    assert f"KV cache {sizing['kvCacheDtype']} ({sizing['kvBytesPerToken']} bytes/token)" in out, out
    assert f"KV pool {sizing['kvBlocks']} blocks x {sizing['blockSize']} tokens" in out, out
    if doc["spec"]["model"]["uri"].startswith("hf://"):
        assert hub.downloads(doc["spec"]["model"]["uri"][5:].partition("@")[0], "config.json") == 1, \
            "the engine did not fetch config.json from the HF_ENDPOINT the operator set"


def test_the_hub_example_as_its_own_tokenmill_serve_process(hub, tmp_path):
    (_, doc) = next((n, d) for n, d in example_services() if n == "hub-model-cached.yaml")
    container = engine_container(doc, hub.url, tmp_path)
    done = run_check_process(container, tmp_path)
    assert done.returncode == 0, f"{container['args']}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.startswith("ok: hf://HuggingFaceTB/SmolLM2-135M-Instruct@main"), done.stdout


def test_the_check_refuses_an_argument_the_engine_would_refuse(hub, tmp_path, monkeypatch, capsys):
    """The control: the same check fails on a max_model_len the bundled model does not support."""
    (_, doc) = next((n, d) for n, d in example_services() if n == "bundled-one-gpu.yaml")
    container = engine_container(doc, hub.url, tmp_path)
    args = list(container["args"])
    args[args.index("--max-model-len") + 1] = "100000"
    rc, out = run_check(container, tmp_path, monkeypatch, capsys, args)
    assert rc == 2 and "max_model_len=100000" in out


def test_the_check_refuses_a_tensor_parallel_size_the_model_cannot_split(hub, tmp_path, monkeypatch, capsys):
    """The control for the TP 3 example: the same argv with --tensor-parallel-size 2 (which sizing and the
    CRD refuse for 9 heads) fails the engine's check, so the example passing above means something."""
    (_, doc) = next((n, d) for n, d in example_services() if n == "bundled-tensor-parallel.yaml")
    container = engine_container(doc, hub.url, tmp_path)
    args = list(container["args"])
    assert args[args.index("--tensor-parallel-size") + 1] == "3"
    args[args.index("--tensor-parallel-size") + 1] = "2"
    rc, out = run_check(container, tmp_path, monkeypatch, capsys, args)
    assert rc != 0 and "tensor_parallel_size=2" in out and "9 attention heads" in out, out
