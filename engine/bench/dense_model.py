"""The benchmarks' dense bf16 case: a Llama of SmolLM2-360M's shape (362M parameters) with random weights,
stored in bf16 as a Hub repo ships it, with the bundled model's tokenizer.

Why: the bundled model is a Q4_1 GGUF that runs from 4-bit codes; most served models are stored in bf16,
where every engine reads 2 bytes per weight (issue 31). Random weights are fine for speed (the engines do
the same arithmetic whatever the values) and need no download. Written once per machine (about 1 GB
of fp32 drawn a tensor at a time, 724 MB on disk) into ~/.cache/tokenmill/models, keyed by
DENSE_MODEL_VERSION. `tokenmill bench peers --models dense-bf16` serves it to every engine;
`python -m tokenmill.engine.bench.dense_model` writes it and prints its folder, which
`tokenmill bench roofline --model FOLDER` (or serve) then loads.
"""

import json
import os
import pathlib
import shutil

DENSE_MODEL_NAME = "dense-bf16-360m"
DENSE_MODEL_VERSION = 1  # bump when the shape, the seed or the files change
# SmolLM2-360M's config.json (HuggingFaceTB/SmolLM2-360M-Instruct), the 360M Llama of issue 31.
DENSE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 960,
    "intermediate_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 15,
    "num_key_value_heads": 5,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "mlp_bias": False,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# HF's initializer range; weights of this scale keep activations and logits finite through 32 layers.
_STD = 0.02


def dense_model_dir() -> pathlib.Path:
    root = pathlib.Path(os.environ.get("TOKENMILL_CACHE", pathlib.Path.home() / ".cache" / "tokenmill"))
    return root / "models" / f"{DENSE_MODEL_NAME}-v{DENSE_MODEL_VERSION}"


def _weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, heads, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes


def ensure_dense_model(tokenizer_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The dense bf16 model's folder, written the first time (seeded: every machine gets the same bits).
    tokenizer_dir: where the tokenizer files come from (default: the bundled model's converted folder)."""
    final = dense_model_dir()
    if (final / "config.json").is_file():
        return final
    import torch
    from safetensors.torch import save_file

    if tokenizer_dir is None:
        from tokenmill.engine.model.resolve import resolve_model

        tokenizer_dir = resolve_model(None)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(360)
    tensors = {}
    for name, shape in _weight_shapes(DENSE_CONFIG).items():
        if len(shape) == 1:  # norm weights near 1, as trained models have them
            t = 1.0 + _STD * torch.randn(shape, generator=gen)
        else:
            t = _STD * torch.randn(shape, generator=gen)
        tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (tmp / "config.json").write_text(json.dumps(DENSE_CONFIG, indent=2) + "\n")
    for f in _TOKENIZER_FILES:
        src = pathlib.Path(tokenizer_dir) / f
        if src.is_file():
            shutil.copy(src, tmp / f)
    tmp.rename(final)  # atomic: a half-written folder is never found under the final name
    return final


if __name__ == "__main__":
    print(ensure_dense_model())
