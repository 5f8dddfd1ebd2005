"""The Hub stand-in (tests/hub_standin.py) as the real huggingface_hub client sees it.

These pin the stand-in's behaviour that the model-source, operator and e2e tests build on: the client
raises its own error types, downloads each file once, resumes a cut download with a Range request.
"""

import pathlib

import pytest
from hub_standin import HubStandin
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("standin"), "llama", vocab_size=256)


@pytest.fixture
def hub(tiny):
    with HubStandin() as hub:
        yield hub


def test_snapshot_info_and_counts(hub, tiny, tmp_path) -> None:
    first = hub.add_repo("tiny/llama", tiny, tags=("v1",))
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "config.json").write_text("{}")
    second = hub.add_repo("tiny/llama", tmp_path / "v2")  # a new commit on main
    assert first != second
    folder = pathlib.Path(
        snapshot_download("tiny/llama", revision="v1", cache_dir=tmp_path / "c", endpoint=hub.url)
    )
    assert folder.name == first
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in tiny.iterdir())
    assert (folder / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert hub.downloads("tiny/llama", "model.safetensors") == 1
    main = pathlib.Path(snapshot_download("tiny/llama", cache_dir=tmp_path / "c", endpoint=hub.url))
    assert main.name == second and [p.name for p in main.iterdir()] == ["config.json"]

    info = HfApi(endpoint=hub.url).model_info("tiny/llama", revision=first, files_metadata=True)
    sizes = {s.rfilename: s.size for s in info.siblings}
    assert sizes["model.safetensors"] == (tiny / "model.safetensors").stat().st_size
    assert info.sha == first and info.safetensors.total > 0


def test_errors_are_the_clients_own(hub, tiny, tmp_path) -> None:
    hub.add_repo("tiny/llama", tiny)
    hub.add_repo("tiny/gated", tiny, gated=True, tokens=("hf_granted",))
    kw = {"cache_dir": tmp_path, "endpoint": hub.url}
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("tiny/nope", **kw)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("tiny/llama", revision="no-such-branch", **kw)
    with pytest.raises(GatedRepoError, match="401"):
        hf_hub_download("tiny/gated", "config.json", token=False, **kw)
    with pytest.raises(GatedRepoError, match="403"):
        hf_hub_download("tiny/gated", "config.json", token="hf_other", **kw)
    assert pathlib.Path(hf_hub_download("tiny/gated", "config.json", token="hf_granted", **kw)).is_file()


def test_cut_download_resumes_with_a_range_request(hub, tmp_path) -> None:
    big = tmp_path / "repo"
    big.mkdir()
    (big / "config.json").write_text("{}")
    data = bytes(range(256)) * (12 * 4096 + 7)  # > the client's 10 MiB read chunk, so some bytes land first
    (big / "model.safetensors").write_bytes(data)
    hub.add_repo("tiny/big", big)
    hub.cut_next_get("tiny/big", "model.safetensors", after_bytes=11 << 20)
    path = hf_hub_download("tiny/big", "model.safetensors", cache_dir=tmp_path / "c", endpoint=hub.url)
    assert pathlib.Path(path).read_bytes() == data
    gets = [r for r in hub.requests("tiny/big", "GET") if r.filename == "model.safetensors"]
    assert [r.status for r in gets] == [200, 206]
    assert gets[1].range is not None and gets[1].range.startswith("bytes=") and gets[1].range != "bytes=0-"


def test_a_bf16_repo_beside_the_gguf_conversion_reports_its_own_dtype(hub, bundled_checkpoint, tmp_path) -> None:
    """The bundled model as the GGUF conversion (fp32) and stored in bf16 (tests/half_checkpoints.py), two
    repos: the client sees each one's safetensors parameter counts by dtype, as the Hub reports them, and
    the bf16 one's weights at half the bytes; its config.json arrives as written (torch_dtype bfloat16)."""
    fp32, bf16 = bundled_checkpoint("float32"), bundled_checkpoint("bfloat16")
    hub.add_repo("HuggingFaceTB/SmolLM2-135M-Instruct", fp32)
    hub.add_repo("standin/SmolLM2-135M-Instruct-bf16", bf16)
    api = HfApi(endpoint=hub.url)
    a = api.model_info("HuggingFaceTB/SmolLM2-135M-Instruct", files_metadata=True)
    b = api.model_info("standin/SmolLM2-135M-Instruct-bf16", files_metadata=True)
    assert list(a.safetensors.parameters) == ["F32"] and list(b.safetensors.parameters) == ["BF16"]
    assert a.safetensors.total == b.safetensors.total > 100_000_000  # 135M parameters either way
    size = {i.id: {s.rfilename: s.size for s in i.siblings}["model.safetensors"] for i in (a, b)}
    assert size[b.id] < 0.51 * size[a.id]  # 2 bytes a weight instead of 4, plus the same header
    folder = pathlib.Path(snapshot_download(b.id, cache_dir=tmp_path / "c", endpoint=hub.url,
                                            allow_patterns=["*.json"]))
    assert (folder / "config.json").read_bytes() == (bf16 / "config.json").read_bytes()
