import pytest
from tokenmill.operator.plan.catalog import (
    GPU_TYPES,
    MODEL_PROFILES,
    ProfileError,
    estimate_num_parameters,
    find_model_profile,
    normalize_model_name,
    profile_from_hf_config,
    profile_from_spec,
)

# Published parameter counts (safetensors index total_size / 2 for the bf16 checkpoints).
PUBLISHED = {
    "SmolLM2-135M": 134_515_008,
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-72B": 72_706_203_648,
    "Mistral-7B": 7_248_023_552,
}

LLAMA_31_8B_CONFIG = {  # meta-llama/Llama-3.1-8B-Instruct config.json (fields sizing reads)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
QWEN25_7B_CONFIG = {  # Qwen/Qwen2.5-7B-Instruct config.json (no head_dim key: hidden / heads)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "max_position_embeddings": 32768, "tie_word_embeddings": False,
}


def test_gpu_catalog_memory_and_product_labels():
    assert GPU_TYPES["nvidia-l4"].memory_bytes == 23034 * 2**20
    assert GPU_TYPES["nvidia-h200-141gb"].memory_bytes == 143771 * 2**20  # 150.75 GB, "141 GB" HBM3e
    assert "NVIDIA-A100-SXM4-80GB" in GPU_TYPES["nvidia-a100-80gb"].products
    assert GPU_TYPES["nvidia-a10g"].products == ("NVIDIA-A10G",)
    # label values have no spaces (GPU feature discovery replaces them with dashes)
    assert all(" " not in v for g in GPU_TYPES.values() for v in g.products)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalog_counts_match_the_shape(name):
    p = MODEL_PROFILES[name]
    bias = name.startswith("Qwen")  # Qwen2 has Q, K and V biases
    estimate = estimate_num_parameters(p.num_hidden_layers, p.hidden_size, p.num_attention_heads,
                                       p.num_key_value_heads, p.head_dim, p.intermediate_size, p.vocab_size,
                                       p.tie_word_embeddings, bias)
    assert p.num_parameters == PUBLISHED[name] == estimate


def test_llama_8b_count_by_hand():
    # per layer: q,o 2 x 4096^2 + k,v 2 x 4096 x 1024 + mlp 3 x 4096 x 14336 + 2 norms = 218,112,000
    # x 32 = 6,979,584,000 + embeddings and lm_head 2 x 128,256 x 4096 + final norm 4096
    assert 32 * 218_112_000 + 2 * 128_256 * 4096 + 4096 == 8_030_261_248


@pytest.mark.parametrize(
    ("uri", "name"),
    [("bundled://smollm2-135m-instruct", "SmolLM2-135M"), ("hf://meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
     ("hf://meta-llama/Meta-Llama-3.1-70B-Instruct", "Llama-3.1-70B"), ("pvc://models/qwen2.5-72b-instruct/", "Qwen2.5-72B"),
     ("hf://mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B"), ("file:///models/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
     ("file:///m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M"), ("Llama-3.1-8B", "Llama-3.1-8B")],
)
def test_find_profile_by_uri(uri, name):
    assert find_model_profile(uri).name == name


def test_unknown_names_do_not_match():
    assert find_model_profile("hf://org/llama-3.1-8b-italian") is None
    assert normalize_model_name("hf://org/llama-3.1-8b-italian") == "llama-3.1-8b-italian"
    assert find_model_profile("pvc://models/my-finetune") is None


def test_profile_from_hf_config_equals_catalog():
    p = profile_from_hf_config(LLAMA_31_8B_CONFIG, "llama")
    cat = MODEL_PROFILES["Llama-3.1-8B"]
    assert p.num_parameters == cat.num_parameters
    assert (p.num_hidden_layers, p.num_key_value_heads, p.head_dim, p.max_position_embeddings) == (32, 8, 128, 131072)
    q = profile_from_hf_config(QWEN25_7B_CONFIG, "qwen")
    assert q.head_dim == 3584 // 28 == 128
    assert q.num_parameters == 7_615_616_512  # qkv biases counted from model_type qwen2


def test_spec_profile_for_an_unknown_model():
    p = profile_from_spec({"layers": 30, "hiddenSize": 576, "numAttentionHeads": 9, "numKeyValueHeads": 3,
                           "intermediateSize": 1536, "vocabSize": 49152, "maxPositionEmbeddings": 8192,
                           "tieWordEmbeddings": True}, None, "tiny")
    assert p.source == "spec" and p.head_dim == 64
    assert p.num_parameters == 134_515_008  # the SmolLM2 shape, estimated


def test_unknown_model_without_profile_says_what_to_add():
    with pytest.raises(ProfileError) as e:
        profile_from_spec(None, None, "my-model")
    assert e.value.reason == "UnknownModelProfile"
    assert "spec.model.profile" in str(e.value) and "intermediateSize" in str(e.value)


def test_incomplete_profile_names_the_missing_fields():
    with pytest.raises(ProfileError) as e:
        profile_from_spec({"layers": 4, "hiddenSize": 256}, None, "x")
    assert e.value.reason == "IncompleteModelProfile"
    assert "numAttentionHeads" in str(e.value) and "vocabSize" in str(e.value) and "layers" not in str(e.value)


def test_profile_overrides_a_catalog_base():
    base = MODEL_PROFILES["Llama-3.1-8B"]
    p = profile_from_spec({"maxPositionEmbeddings": 8192}, base, "ft")
    assert p.source == "catalog+spec" and p.max_position_embeddings == 8192
    assert p.num_parameters == base.num_parameters  # shape unchanged: the published count stays
    wider = profile_from_spec({"vocabSize": 128256 + 256}, base, "ft")
    assert wider.num_parameters == base.num_parameters + 2 * 256 * 4096  # re-estimated for the new shape
    assert profile_from_spec({}, base, "ft") is base


def test_heads_must_divide():
    with pytest.raises(ProfileError) as e:
        profile_from_spec({"numKeyValueHeads": 5}, MODEL_PROFILES["Llama-3.1-8B"], "x")
    assert e.value.reason == "InvalidModelProfile" and "32" in str(e.value) and "5" in str(e.value)


def test_non_positive_numbers_are_refused():
    with pytest.raises(ProfileError, match="layers must be a positive integer"):
        profile_from_spec({"layers": 0}, MODEL_PROFILES["Llama-3.1-8B"], "x")
