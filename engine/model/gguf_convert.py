"""A GGUF file (llama.cpp's format) as a Hugging Face folder: config.json from the GGUF metadata, the
tokenizer and chat template from its tokenizer metadata (converted by transformers, tokenizer only).

The engine loads the weights from the GGUF's own blocks (gguf_weights.py; the cache folder links to the
file: gguf_cache.py). convert_gguf(..., weights=True) also writes them dequantized with the `gguf` package
to fp32 safetensors, every value exactly as gguf dequantizes it: the reference that parity tests load
with transformers and with the engine (4 bytes per parameter on disk; tests only).
llama.cpp's converter reorders the Q and K rows of Llama-architecture models for its interleaved RoPE;
unpermute_qk undoes that (on values here, on rows of blocks in gguf_weights.py).
"""

import json
import pathlib
from typing import Any

import numpy as np
import torch

# GGUF general.architecture -> (HF architecture, HF model_type).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Per-layer GGUF tensor suffix -> HF name inside model.layers.N.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 regex (llama-vocab.cpp);
# transformers' GGUF tokenizer conversion omits that step.
_DIGIT_SPLIT_PRE_TOKENIZERS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_SHARD_BYTES = 2 << 30  # bounds the fp32 tensors held in memory while converting a large model


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message names the file and the problem."""


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows: per head, interleaved (re, im) pairs -> [re half | im half]."""
    # llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _f32(value: float) -> float:
    """GGUF stores float32; 1e-5 reads back as 9.9999997e-06. Take the shortest decimal that rounds to it."""
    return float(str(np.float32(value)))


def _require(path: pathlib.Path, reader: Any, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"{path}: GGUF metadata key {key!r} is missing")
    return value


def gguf_config(path: pathlib.Path, reader: Any) -> dict[str, Any]:
    """An HF config.json dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            f"{path}: per-dimension RoPE frequency factors (rope_freqs.weight, e.g. Llama 3.1 scaling) are not "
            "supported from GGUF; load the Hugging Face folder of this model instead"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not supported from GGUF; supported: none")

    hidden = int(_require(path, reader, f"{arch}.embedding_length"))
    num_heads = int(_require(path, reader, f"{arch}.attention.head_count"))
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    if not isinstance(kv_heads, int):
        raise GGUFError(f"{path}: per-layer head_count_kv {kv_heads!r} is not supported")
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{path}: partial RoPE (rope.dimension_count={rope_dim} < head_dim={head_dim}) is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_size = _field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab_size is None:
        raise GGUFError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(_require(path, reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(path, reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_require(path, reader, f"{arch}.context_length")),
        "rms_norm_eps": _f32(_require(path, reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if model_type == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if model_type == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    return config


def hf_tensor_name(path: pathlib.Path, gguf_name: str) -> str:
    """The Hugging Face name of GGUF tensor gguf_name (llama.cpp's names)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise GGUFError(f"{path}: unexpected tensor {gguf_name!r} (not part of a supported Llama/Qwen model)")


def _dequantize(path: pathlib.Path, tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        w = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise GGUFError(
            f"{path}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from None
    # GGUF shapes list the fastest dimension first; numpy/torch order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if w.size != int(np.prod(shape)):
        raise GGUFError(f"{path}: tensor {tensor.name} holds {w.size} values, its shape {shape} needs {np.prod(shape)}")
    return w.reshape(shape)


def convert_weights(path: pathlib.Path, reader: Any, config: dict[str, Any], out_dir: pathlib.Path) -> None:
    """Dequantize every tensor, undo the Q/K permutation, write fp32 safetensors (sharded when large)."""
    from safetensors.torch import save_file

    permuted = config["model_type"] == "llama"  # llama.cpp permutes Q/K only for its Llama architecture
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    files: list[pathlib.Path] = []

    def flush() -> None:
        nonlocal shard_bytes
        tmp = out_dir / f"shard-{len(files):05d}.safetensors"
        save_file(shards[-1], str(tmp), metadata={"format": "pt"})
        files.append(tmp)
        shards[-1] = {}
        shard_bytes = 0

    for tensor in reader.tensors:
        name = hf_tensor_name(path, tensor.name)
        w = _dequantize(path, tensor)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if name.endswith("q_proj.weight") else config["num_key_value_heads"]
            w = unpermute_qk(w, heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # F32 tensors come back as read-only views of the memory-mapped file
            w = w.copy()
        shards[-1][name] = torch.from_numpy(w)
        shard_bytes += w.size * 4
        if shard_bytes >= _SHARD_BYTES:
            flush()
    if shards[-1]:
        flush()
    if len(files) == 1:
        files[0].rename(out_dir / "model.safetensors")
        return
    # HF's sharded naming plus the index transformers reads.
    weight_map: dict[str, str] = {}
    from safetensors import safe_open

    for i, f in enumerate(files):
        final = out_dir / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        f.rename(final)
        with safe_open(str(final), framework="pt") as sf:
            for key in sf.keys():
                weight_map[key] = final.name
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_tokenizer(path: pathlib.Path, reader: Any, config: dict[str, Any], out_dir: pathlib.Path) -> None:
    """Tokenizer + chat template via transformers' GGUF tokenizer conversion, BOS behaviour checked."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types for a bad tokenizer section
        raise GGUFError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from e
    if _field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE_TOKENIZERS:
        backend = tok.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )
    # The tokenizer must add BOS exactly when llama.cpp would: the file's flag, else llama.cpp's
    # default (sentencepiece vocabularies add it, BPE ones do not).
    want_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if want_bos is None:
        want_bos = _field(reader, "tokenizer.ggml.model") == "llama"
    if bool(tok.add_bos_token) != bool(want_bos):
        tok.add_bos_token = bool(want_bos)
    tok.model_max_length = config["max_position_embeddings"]
    tok.save_pretrained(str(out_dir))
    # Check what a reload gives, since that is what the engine will use.
    saved = AutoTokenizer.from_pretrained(str(out_dir))
    bos_id = config.get("bos_token_id")
    ids = saved("a")["input_ids"]
    adds_bos = bos_id is not None and len(ids) > 0 and ids[0] == bos_id
    if adds_bos != bool(want_bos):
        raise GGUFError(
            f"{path}: the GGUF says add_bos_token={bool(want_bos)} (BOS id {bos_id}), "
            f"but the converted tokenizer {'adds' if adds_bos else 'does not add'} it"
        )


def check_tensors(path: pathlib.Path) -> None:
    """Every tensor named as a supported model's, of a type the loader reads, inside the file (header only)."""
    from tokenmill.engine.gguf_header import read_gguf_header
    from tokenmill.engine.quant_memory import SUPPORTED_GGUF

    try:
        header = read_gguf_header(path)
    except ValueError as e:
        raise GGUFError(str(e)) from None
    for t in header.tensors:
        hf_tensor_name(path, t.name)
        if t.type_name not in SUPPORTED_GGUF:
            raise GGUFError(
                f"{path}: tensor {t.name} uses quantization {t.type_name}; supported: {', '.join(sorted(SUPPORTED_GGUF))}"
            )


def convert_gguf(path: str | pathlib.Path, out_dir: str | pathlib.Path, weights: bool = True) -> None:
    """Write config.json, generation_config.json and tokenizer files for `path` into out_dir, and with
    `weights` its tensors dequantized to fp32 safetensors (the reference copy parity tests compare
    against; the engine itself loads the GGUF's blocks: gguf_weights.py)."""
    from gguf import GGUFReader

    path = pathlib.Path(path)
    out_dir = pathlib.Path(out_dir)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # GGUFReader raises ValueError/KeyError/IndexError on damaged files
        raise GGUFError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    config = gguf_config(path, reader)
    check_tensors(path)
    if weights:
        try:
            convert_weights(path, reader, config, out_dir)
        except GGUFError:
            raise
        except (ValueError, IndexError, TypeError) as e:  # truncated tensor data surfaces here
            raise GGUFError(f"{path}: tensor data is damaged or truncated: {type(e).__name__}: {e}") from None
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    convert_tokenizer(path, reader, config, out_dir)
