"""Model sources (engine/model/source.py): URI parsing, and hub downloads by the real huggingface_hub
client from the Hub stand-in (tests/hub_standin.py) via HF_ENDPOINT, counted by the stand-in."""

import json
import pathlib
import shutil
from importlib import metadata

import pytest
from hub_standin import HubStandin
from tiny_models import make_tiny_model
from tokenmill.engine.model.hub_download import download_hf
from tokenmill.engine.model.source import ALLOW_PATTERNS, ModelSourceError, parse_model_source


# ---- parsing -----------------------------------------------------------------------------------
def test_every_uri_form_parses(tmp_path, monkeypatch) -> None:
    s = parse_model_source("hf://Org/Name-1.5B@v1.0")
    assert (s.scheme, s.repo_id, s.revision, s.default_served_name) == (
        "hf",
        "Org/Name-1.5B",
        "v1.0",
        "Org/Name-1.5B",
    )
    assert parse_model_source("hf://org/name").revision == "main"
    assert parse_model_source("org/name", revision="abc").revision == "abc"  # bare ORG/NAME, as vLLM takes it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    local = parse_model_source("org/local")  # an existing path wins over the hub
    assert local.scheme == "path" and local.path == pathlib.Path("org/local")
    monkeypatch.setenv("TOKENMILL_PVC_ROOT", str(tmp_path / "mnt"))
    assert parse_model_source("pvc://claim/llama/8b/").path == tmp_path / "mnt" / "claim" / "llama" / "8b"
    monkeypatch.delenv("TOKENMILL_PVC_ROOT")
    assert parse_model_source("pvc://claim/m").path == pathlib.Path(
        "/models/claim/m"
    )  # where the operator mounts
    assert parse_model_source("file:///opt/model").path == pathlib.Path("/opt/model")
    assert parse_model_source("bundled://smollm2-135m-instruct").scheme == "bundled"
    assert parse_model_source(None).default_served_name == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("uri", "revision", "message"),
    [
        ("s3://bucket/model", None, "unknown scheme s3://"),
        ("pvc://claim-only", None, r"expected pvc://CLAIM/PATH"),
        ("file://relative/path", None, "three slashes"),
        ("bundled://llama-70b", None, "the only bundled model is bundled://smollm2-135m-instruct"),
        ("hf://no-org", None, "expected hf://ORG/NAME"),
        ("hf://org/name@", None, "empty revision"),
        ("hf://org/name@v1", "v2", "pins revision 'v1' but --revision is 'v2'"),
        ("/some/folder", "v1", "applies to hub models only"),
    ],
)
def test_bad_uris_say_what_is_wrong(uri, revision, message) -> None:
    with pytest.raises(ModelSourceError, match=message):
        parse_model_source(uri, revision)


def test_missing_local_sources_name_the_path(tmp_path, monkeypatch) -> None:
    from tokenmill.engine.model.resolve import resolve_model

    monkeypatch.setenv("TOKENMILL_PVC_ROOT", str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match=rf"{tmp_path}/claim/m does not exist \(claims are mounted under"
    ):
        resolve_model("pvc://claim/m")
    with pytest.raises(FileNotFoundError, match="does not exist in this image"):
        resolve_model(f"file://{tmp_path}/absent")
    (tmp_path / "claim" / "m").mkdir(parents=True)
    (tmp_path / "claim" / "m" / "config.json").write_text("{}")
    assert resolve_model("pvc://claim/m") == tmp_path / "claim" / "m"
    assert resolve_model(f"file://{tmp_path}/claim/m") == tmp_path / "claim" / "m"


# ---- downloads from the stand-in ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_model_dir) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("src"), "llama", tokenizer_dir=bundled_model_dir)


@pytest.fixture(scope="module")
def hub(tiny, tmp_path_factory):
    """tiny/llama: v1 (max_position_embeddings 512) and main (256); extra files the engine never loads."""
    base = tmp_path_factory.mktemp("repos")
    v1 = base / "v1"
    shutil.copytree(tiny, v1)
    (v1 / "pytorch_model.bin").write_bytes(b"not loaded")
    (v1 / "original").mkdir()
    (v1 / "original" / "consolidated.safetensors").write_bytes(b"not loaded either")
    (v1 / "README.md").write_text("# tiny")
    v2 = base / "v2"
    shutil.copytree(v1, v2)
    config = json.loads((v2 / "config.json").read_text())
    config["max_position_embeddings"] = 256
    (v2 / "config.json").write_text(json.dumps(config))
    with HubStandin() as hub:
        hub.shas = {
            "v1": hub.add_repo("tiny/llama", v1, tags=("v1",)),
            "main": hub.add_repo("tiny/llama", v2),
        }
        hub.add_repo("tiny/gated", tiny, gated=True, tokens=("hf_granted",))
        yield hub


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch) -> HubStandin:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub.reset_log()
    return hub


def _max_pos(folder: pathlib.Path) -> int:
    return json.loads((folder / "config.json").read_text())["max_position_embeddings"]


def test_revisions_are_pinned_and_only_loaded_files_fetched(hub_env, tiny, tmp_path) -> None:
    hub = hub_env
    v1 = download_hf(parse_model_source("hf://tiny/llama@v1"))
    main = download_hf(parse_model_source("tiny/llama"))
    by_sha = download_hf(parse_model_source("hf://tiny/llama", revision=hub.shas["main"]))
    assert (v1.name, main.name, by_sha) == (hub.shas["v1"], hub.shas["main"], main)
    assert (_max_pos(v1), _max_pos(main)) == (512, 256)
    assert str(v1).startswith(str(tmp_path / "hf" / "hub"))  # HF_HOME's cache
    assert (v1 / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    fetched = {r.filename for r in hub.requests("tiny/llama") if r.filename}
    assert fetched == {p.name for p in tiny.iterdir()}
    assert not {"pytorch_model.bin", "README.md", "original/consolidated.safetensors"} & fetched
    assert set(fetched) <= {*ALLOW_PATTERNS, "model.safetensors"}
    # The engine names itself in every request (the operator's lookups say tokenmill-operator).
    assert {r.user_agent.split(";")[0] for r in hub.requests("tiny/llama")} == {
        f"tokenmill/{metadata.version('tokenmill')}"
    }


def test_a_cached_snapshot_is_used_without_any_request(hub_env) -> None:
    hub = hub_env
    first = download_hf(parse_model_source("hf://tiny/llama@v1"))
    assert hub.downloads("tiny/llama", "model.safetensors") == 1
    hub.reset_log()
    for uri in ("hf://tiny/llama@v1", f"hf://tiny/llama@{hub.shas['v1']}"):
        assert download_hf(parse_model_source(uri)) == first
    assert hub.requests() == []


def test_config_only_then_full_download_fetches_the_rest(hub_env) -> None:
    hub = hub_env
    folder = download_hf(parse_model_source("hf://tiny/llama@v1"), config_only=True)
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    assert hub.downloads("tiny/llama", "model.safetensors") == 0
    full = download_hf(parse_model_source("hf://tiny/llama@v1"))  # the config-only folder is not "complete"
    assert full == folder and (full / "model.safetensors").is_file() and (full / "tokenizer.json").is_file()
    assert hub.downloads("tiny/llama", "config.json") == 1


def test_gated_repo_needs_a_granted_token(hub_env, monkeypatch) -> None:
    with pytest.raises(ModelSourceError, match=r"^hf://tiny/gated@main is a gated repo on .*: set HF_TOKEN"):
        download_hf(parse_model_source("hf://tiny/gated"))
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(ModelSourceError, match=r"the token in HF_TOKEN has no access: request access at"):
        download_hf(parse_model_source("hf://tiny/gated"))
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert (download_hf(parse_model_source("hf://tiny/gated")) / "model.safetensors").is_file()


def test_missing_repo_and_revision_name_them(hub_env) -> None:
    with pytest.raises(
        ModelSourceError, match=r"^repo tiny/absent not found on http://127\.0\.0\.1:\d+: check"
    ):
        download_hf(parse_model_source("hf://tiny/absent"))
    with pytest.raises(ModelSourceError, match=r"^revision 'v9' not found in tiny/llama on http"):
        download_hf(parse_model_source("hf://tiny/llama@v9"))


def test_unreachable_hub_says_so(hub_env, monkeypatch) -> None:
    from conftest_server import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(
        ModelSourceError, match=rf"^cannot reach {url} to download hf://tiny/llama@v1 .*Connect"
    ):
        download_hf(parse_model_source("hf://tiny/llama@v1"))


def test_a_cut_download_resumes(hub_env, tiny) -> None:
    hub = hub_env
    size = (tiny / "model.safetensors").stat().st_size
    assert size > 11 << 20  # the client writes in 10 MiB reads: the cut must come after the first
    hub.cut_next_get("tiny/llama", "model.safetensors", after_bytes=11 << 20)
    folder = download_hf(parse_model_source("hf://tiny/llama@v1"))
    assert (folder / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    gets = [r for r in hub.requests("tiny/llama", "GET") if r.filename == "model.safetensors"]
    assert [r.status for r in gets] == [200, 206]
    start = int(gets[1].range.removeprefix("bytes=").split("-")[0])
    assert 0 < start <= 11 << 20  # resumed from what had arrived, not from zero
