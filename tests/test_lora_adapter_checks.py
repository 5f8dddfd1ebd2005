"""What the engine refuses in a PEFT folder, each with a message that names the problem and the limit: the
checks the API process runs (torch-free) and the engine core runs again before any rank loads a tensor."""

import json
import pathlib
import shutil

import pytest
from lora_adapters import make_peft_adapter
from tiny_models import make_tiny_model
from tokenmill.engine.lora.peft import LoRAAdapterError, check_lora_name, read_adapter
from tokenmill.engine.model_config import load_model_config


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("lora-checks")
    llama = make_tiny_model(root, "llama", vocab_size=1000)
    qwen3 = make_tiny_model(root, "qwen3", vocab_size=1000)  # head_dim 32: other q/k/v shapes
    return {
        "llama": llama,
        "good": make_peft_adapter(llama, root / "good", r=8),
        "qwen3_adapter": make_peft_adapter(qwen3, root / "q3", r=8, targets=("q_proj", "v_proj")),
        "root": root,
    }


def _copy(models, name: str) -> pathlib.Path:
    dest = models["root"] / f"copy-{name}"
    shutil.rmtree(dest, ignore_errors=True)
    return pathlib.Path(shutil.copytree(models["good"], dest))


def _edit_config(folder: pathlib.Path, **changes) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def test_a_good_adapter_reads(models):
    info = read_adapter(models["good"], load_model_config(models["llama"]), max_lora_rank=8)
    assert info.rank == 8 and len(info.tensors) == 2 * 7 and info.lora_alpha == 16


def test_rank_above_the_limit_names_both(models):
    with pytest.raises(LoRAAdapterError, match=r"its rank is 8 .*above --max-lora-rank 4; serve it with --max-lora-rank 8"):
        read_adapter(models["good"], load_model_config(models["llama"]), max_lora_rank=4, name="good")


def test_an_adapter_for_another_model_shape_is_refused(models):
    with pytest.raises(LoRAAdapterError, match=r"q_proj has lora_A \[8, 64\] and lora_B \[128, 8\]; this model needs"
                                               r" \[r, 64\] and \[64, r\] \(is the adapter for another base model\?\)"):
        read_adapter(models["qwen3_adapter"], load_model_config(models["llama"]), max_lora_rank=16)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_modules": ["c_attn", "q_proj"]}, r"target module 'c_attn' is not one LlamaForCausalLM has"),
        ({"use_dora": True}, r"DoRA \(use_dora\)"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save \['lm_head'\]"),
        ({"bias": "all"}, r"trained biases \(bias='all'\)"),
        ({"rank_pattern": {"q_proj": 4}}, r"per-module ranks"),
        ({"peft_type": "IA3"}, r"peft_type is 'IA3'; only LORA"),
        ({"lora_alpha": 0}, r"lora_alpha must be a positive number"),
    ],
)
def test_unsupported_peft_options_are_refused_by_name(models, changes, message):
    folder = _copy(models, "cfg")
    _edit_config(folder, **changes)
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(folder, load_model_config(models["llama"]), max_lora_rank=16)


def test_tensors_for_a_module_the_model_lacks_are_refused(models):
    from safetensors.torch import load_file, save_file

    folder = _copy(models, "embed")
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = tensors[next(iter(tensors))].clone()
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match=r"targets 'embed_tokens', which this engine cannot adapt"):
        read_adapter(folder, load_model_config(models["llama"]), max_lora_rank=16)


def test_missing_files_and_bad_names(models, tmp_path):
    mc = load_model_config(models["llama"])
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        read_adapter(tmp_path / "nope", mc, 16)
    folder = _copy(models, "bin")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match=r"no adapter_model.safetensors \(found adapter_model.bin: only safetensors"):
        read_adapter(folder, mc, 16)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match=r"no adapter_config\.json"):
        read_adapter(folder, mc, 16)
    for bad in ["", "a,b", " a", "x" * 300]:
        with pytest.raises(LoRAAdapterError, match="is not valid"):
            check_lora_name(bad)
    check_lora_name("team-a/sql-v2")


def test_hub_adapters_download_only_their_two_files_at_the_revision(models, tmp_path, monkeypatch):
    from hub_standin import HubStandin
    from tokenmill.engine.model.resolve import resolve_adapter
    from tokenmill.engine.model.source import ModelSourceError

    folder = _copy(models, "hub")
    (folder / "README.md").write_text("not fetched")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubStandin() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        sha = hub.add_repo("acme/sql-lora", folder, tags=("v1",))
        got = resolve_adapter("hf://acme/sql-lora@v1")
        assert got.name == sha and str(got).startswith(str(tmp_path / "hf"))
        assert {p.name for p in got.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
        read_adapter(got, load_model_config(models["llama"]), max_lora_rank=8)
        with pytest.raises(ModelSourceError, match="repo acme/missing not found"):
            resolve_adapter("hf://acme/missing")
