"""ModelConfig parsing, checked against transformers' own config classes (the reference for defaults)."""

import json
import pathlib

import pytest
from tokenmill.engine.model_config import SUPPORTED_ARCHITECTURES, load_model_config, model_config_from_dict

from tests.tiny_models import TINY_ARCHS, _tiny_config


def _hf_config(model_dir: pathlib.Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _assert_matches_hf(ours, hf) -> None:
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert ours.vocab_size == hf.vocab_size
    assert ours.hidden_size == hf.hidden_size
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.num_hidden_layers == hf.num_hidden_layers
    assert ours.num_attention_heads == hf.num_attention_heads
    assert ours.num_key_value_heads == (hf.num_key_value_heads or hf.num_attention_heads)
    assert ours.head_dim == head_dim
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    eos = hf.eos_token_id
    assert ours.eos_token_ids == (() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))
    assert ours.bos_token_id == hf.bos_token_id


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_saved_tiny_configs_parse_like_transformers(tmp_path, arch) -> None:
    config = _tiny_config(arch, vocab_size=1000)
    config.save_pretrained(tmp_path)  # use_diff: fields equal to the class default are left out
    ours = load_model_config(tmp_path)
    _assert_matches_hf(ours, _hf_config(tmp_path))
    assert ours.architecture == config.architectures[0]
    assert ours.qk_norm == (arch == "qwen3")
    assert ours.qkv_bias == (arch == "qwen2")
    assert (ours.rope_scaling is not None) == (arch == "llama3_rope")


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_minimal_config_gets_the_same_defaults_as_transformers(tmp_path, arch) -> None:
    model_type = {"Llama": "llama", "Mistral": "mistral", "Qwen2": "qwen2", "Qwen3": "qwen3"}[
        arch.removesuffix("ForCausalLM")
    ]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type}))
    ours = load_model_config(tmp_path)
    hf = _hf_config(tmp_path)
    _assert_matches_hf(ours, hf)
    # transformers resolves the effective window into `sliding_window` (None when unused).
    assert ours.sliding_window == hf.sliding_window if hasattr(hf, "sliding_window") else ours.sliding_window is None


def test_llama3_rope_scaling_in_old_and_new_spelling() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 131072}
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = model_config_from_dict({**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **params}})
    new = model_config_from_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **params}})
    assert old == new
    assert old.rope_theta == 500000.0
    assert old.rope_scaling.factor == 8.0 and old.rope_scaling.original_max_position_embeddings == 8192


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        model_config_from_dict({"architectures": ["GPT2LMHeadModel"]})
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


def test_unsupported_rope_scaling_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'yarn'.*supported: 'default', 'llama3'"):
        model_config_from_dict({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "yarn", "factor": 4}})


def test_eos_token_id_as_int_or_list() -> None:
    one = model_config_from_dict({"architectures": ["LlamaForCausalLM"], "eos_token_id": 7})
    many = model_config_from_dict({"architectures": ["LlamaForCausalLM"], "eos_token_id": [7, 9]})
    assert one.eos_token_ids == (7,)
    assert many.eos_token_ids == (7, 9)
    with pytest.raises(ValueError, match="eos_token_id"):
        model_config_from_dict({"architectures": ["LlamaForCausalLM"], "eos_token_id": "x"})


def test_sliding_window_caps_max_model_len_instead_of_computing_wrong_attention() -> None:
    mistral = {"architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    assert model_config_from_dict({**mistral, "sliding_window": 4096}).max_model_len == 4096
    assert model_config_from_dict({**mistral, "sliding_window": None}).max_model_len == 32768
    qwen = {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768, "sliding_window": 4096}
    assert model_config_from_dict({**qwen, "use_sliding_window": False}).max_model_len == 32768
    # Window on, but max_window_layers covers every layer: no layer slides.
    on = {**qwen, "use_sliding_window": True, "num_hidden_layers": 4}
    assert model_config_from_dict({**on, "max_window_layers": 4}).max_model_len == 32768
    assert model_config_from_dict({**on, "max_window_layers": 2}).max_model_len == 4096


def test_bad_numbers_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads=6 must be a multiple of num_key_value_heads=4"):
        model_config_from_dict({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        model_config_from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 0})


def test_missing_or_corrupt_config_names_the_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model_config(tmp_path)


def test_bundled_model_config_matches_the_published_shape(bundled_model_dir) -> None:
    # Figures from the model card / reference notes, not from our converter.
    c = load_model_config(bundled_model_dir)
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings, c.rope_theta) == (49152, 8192, 100000.0)
    assert c.rms_norm_eps == 1e-5 and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
