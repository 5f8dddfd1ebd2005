"""GGUF conversion: exact round trips through files written the way llama.cpp writes them, the bundled
file checked against transformers' own GGUF processing, caching and bad files."""

import json
import os
import pathlib

import numpy as np
import pytest
import torch
from tokenmill.engine.model import gguf_convert
from tokenmill.engine.model.bundled import bundled_gguf_path
from tokenmill.engine.model.gguf_cache import dequantized_copy_cached
from tokenmill.engine.model.loader import load_model
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.model.tokenizer import load_tokenizer
from tokenmill.engine.model_config import load_model_config

from tests.test_model_llama import _forward_all, _hf_logits, _hf_model, _ours
from tests.tiny_models import make_tiny_model

TINY_VOCAB = 300


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: RoPE pairs interleaved per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor names (gguf-py constants), written out independently of the converter's table."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    suffix = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }[rest]
    return f"blk.{layer}.{suffix}"


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of TINY_VOCAB tokens: 256 bytes, 3 control tokens, merges "Ġ" + letter."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    merges = []
    for c in letters[: TINY_VOCAB - len(tokens)]:
        merges.append(f"Ġ {c}")
        tokens.append(f"Ġ{c}")
        types.append(1)
    return tokens, types, merges


def write_gguf(
    path: pathlib.Path, hf_dir: pathlib.Path, gguf_arch: str, quantize: tuple[str, ...] = (), add_bos: bool = False,
    types: dict[str, str] | None = None,
) -> pathlib.Path:
    """Write hf_dir's weights and config as llama.cpp would: F32 tensors (Q8_0 for names in quantize; the
    GGUF type types[name] for names there, K-quants by engine/bench/gguf_quantize.py)."""
    import gguf
    from safetensors.torch import load_file
    from tokenmill.engine.bench import gguf_quantize as gguf_quants

    types = {**{name: "Q8_0" for name in quantize}, **(types or {})}

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens, token_types, merges = _tiny_vocab()
    assert len(tokens) == cfg["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, t in load_file(hf_dir / "model.safetensors").items():
        a = t.numpy()
        if gguf_arch == "llama" and name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, heads)
        if gguf_arch == "llama" and name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, kv_heads)
        if name in types:
            q = gguf_quants.quantize(a, types[name])
            w.add_tensor(_gguf_name(name), q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[types[name]])
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> pathlib.Path:
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _cache_entries(cache_home: pathlib.Path) -> list[str]:
    root = cache_home / "tokenmill" / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.mark.parametrize(("arch", "gguf_arch"), [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_round_trip_restores_the_exact_weights_and_logits(tmp_path, cache_home, arch, gguf_arch) -> None:
    from safetensors.torch import load_file

    hf_dir = make_tiny_model(tmp_path, arch, vocab_size=TINY_VOCAB)
    gguf_file = write_gguf(tmp_path / f"{arch}.gguf", hf_dir, gguf_arch)
    model_dir = resolve_model(gguf_file)  # what the engine loads: the file's own tensors

    original = load_file(hf_dir / "model.safetensors")
    converted = load_file(dequantized_copy_cached(gguf_file) / "model.safetensors")
    assert set(converted) == set(original)
    for name, t in original.items():
        assert torch.equal(converted[name], t), name  # incl. Q/K rows back in HF order

    ours = load_model_config(model_dir)
    hf_cfg = load_model_config(hf_dir)
    for field in ("architecture", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rope_theta", "rms_norm_eps", "tie_word_embeddings", "qkv_bias", "qk_norm", "vocab_size"):
        assert getattr(ours, field) == getattr(hf_cfg, field), field

    model, kv = _ours(model_dir)
    seq = list(range(3, 60))
    logits = _forward_all(model, kv, [seq], [[4, 0, 9, 2]], [0], [len(seq)])
    # Our CPU kernels add in another order than torch (AVX2 FMA tiles): test_model_llama's fp32 bound.
    torch.testing.assert_close(logits, _hf_logits(_hf_model(hf_dir), seq), rtol=1e-4, atol=1e-4)

    tok = load_tokenizer(model_dir)
    assert tok("hello world").input_ids[0] != 257  # the file says: no BOS
    assert tok.decode(tok(" a b c").input_ids) == " a b c"


def test_large_models_are_written_in_shards_that_both_loaders_read(tmp_path, cache_home, monkeypatch) -> None:
    monkeypatch.setattr(gguf_convert, "_SHARD_BYTES", 100_000)  # ~4 tensors per shard for the tiny model
    hf_dir = make_tiny_model(tmp_path, "qwen2", vocab_size=TINY_VOCAB)
    model_dir = dequantized_copy_cached(write_gguf(tmp_path / "s.gguf", hf_dir, "qwen2"))
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    seq = list(range(5, 40))
    model, kv = _ours(model_dir)
    logits = _forward_all(model, kv, [seq], [[0, 1, 2]], [0], [len(seq)])
    expect = _hf_logits(_hf_model(hf_dir), seq)
    torch.testing.assert_close(logits, expect, rtol=1e-4, atol=1e-4)  # our kernels' summation order
    torch.testing.assert_close(_hf_logits(_hf_model(model_dir), seq), expect, rtol=1e-5, atol=1e-5)


def test_tokenizer_adds_bos_exactly_when_the_gguf_says_so(tmp_path, cache_home) -> None:
    hf_dir = make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB)
    with_bos = load_tokenizer(resolve_model(write_gguf(tmp_path / "bos.gguf", hf_dir, "llama", add_bos=True)))
    without = load_tokenizer(resolve_model(write_gguf(tmp_path / "nobos.gguf", hf_dir, "llama", add_bos=False)))
    assert with_bos(" a b").input_ids == [257, *without(" a b").input_ids]  # 257: the file's BOS id
    assert 257 not in without(" a b").input_ids


def test_quantized_tensors_dequantize_to_gguf_values_with_rows_in_hf_order(tmp_path, cache_home) -> None:
    import gguf
    from safetensors.torch import load_file

    hf_dir = make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB)
    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.0.mlp.down_proj.weight")
    model_dir = dequantized_copy_cached(write_gguf(tmp_path / "q.gguf", hf_dir, "llama", quantize=names))
    original = load_file(hf_dir / "model.safetensors")
    converted = load_file(model_dir / "model.safetensors")
    for name in names:
        # Q8_0 blocks run along each row, and the Q/K permutation moves whole rows, so the converted
        # tensor must equal HF's tensor quantized and dequantized in place.
        a = original[name].numpy()
        q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
        expect = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape))
        assert torch.equal(converted[name], expect), name
        assert not torch.equal(converted[name], original[name])


def test_second_resolve_reuses_the_cache_without_converting(tmp_path, cache_home, monkeypatch) -> None:
    hf_dir = make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB)
    gguf_file = write_gguf(tmp_path / "m.gguf", hf_dir, "llama")
    first = resolve_model(gguf_file)
    stamp = (first / "config.json").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    assert resolve_model(gguf_file) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert _cache_entries(cache_home) == [first.name]
    # The cache is keyed by content: the same bytes with a new mtime (another venv's copy) reuse it...
    st = gguf_file.stat()
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert resolve_model(gguf_file) == first
    # ...and a changed file (other bytes, one of them quantized) is converted, not served stale.
    write_gguf(gguf_file, hf_dir, "llama", quantize=("model.embed_tokens.weight",))
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model(gguf_file)


def test_a_failed_conversion_leaves_nothing_behind_and_the_next_one_succeeds(tmp_path, cache_home, monkeypatch) -> None:
    hf_dir = make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB)
    gguf_file = write_gguf(tmp_path / "m.gguf", hf_dir, "llama")
    real = gguf_convert.convert_tokenizer

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash after the weights were written")

    monkeypatch.setattr(gguf_convert, "convert_tokenizer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(gguf_file)
    assert _cache_entries(cache_home) == []  # no half folder, no temp dir
    monkeypatch.setattr(gguf_convert, "convert_tokenizer", real)
    model_dir = resolve_model(gguf_file)
    assert (model_dir / "model.gguf").resolve() == gguf_file.resolve() and (model_dir / "tokenizer.json").is_file()


def test_temp_dirs_left_by_a_killed_conversion_are_cleaned_up_later(tmp_path, cache_home) -> None:
    import time

    root = cache_home / "tokenmill" / "models"
    old = root / ".m-0123.tmp-dead"
    fresh = root / ".m-4567.tmp-busy"  # may belong to a conversion running right now
    for d in (old, fresh):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    hf_dir = make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB)
    model_dir = resolve_model(write_gguf(tmp_path / "m.gguf", hf_dir, "llama"))
    assert _cache_entries(cache_home) == sorted([fresh.name, model_dir.name])


def test_corrupt_and_truncated_gguf_files_are_named(tmp_path, cache_home) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"junk\.gguf is not a readable GGUF file"):
        resolve_model(junk)

    hf_dir = make_tiny_model(tmp_path, "llama", vocab_size=TINY_VOCAB)
    whole = write_gguf(tmp_path / "whole.gguf", hf_dir, "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        resolve_model(cut)
    assert _cache_entries(cache_home) == []

    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        resolve_model(tmp_path / "nope.gguf")


def test_unknown_gguf_architecture_lists_the_supported_ones(tmp_path, cache_home) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'phi3' is not supported; supported: llama, qwen2, qwen3"):
        resolve_model(path)


def test_bundled_gguf_q_k_unpermuted_like_transformers_does(bundled_model_dir) -> None:
    # transformers' GGUF loader (an independent implementation) applied to the same dequantized tensors.
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = GGUFReader(str(bundled_gguf_path()))
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(bundled_model_dir / "model.safetensors"), framework="pt") as f:
        for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                                   ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight")):
            t = tensors[gguf_name]
            raw = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
            expect = processor.process(weights=raw, name=gguf_name).weights
            assert torch.equal(f.get_tensor(hf_name), torch.from_numpy(np.ascontiguousarray(expect)))


def test_bundled_model_has_the_published_parameter_count(bundled_model_dir) -> None:
    model = load_model(bundled_model_dir, load_model_config(bundled_model_dir), torch.float32, "cpu")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings


def test_bundled_tokenizer_adds_no_bos_splits_digits_and_has_chatml(bundled_model_dir) -> None:
    tok = load_tokenizer(bundled_model_dir)
    ids = tok("Once upon a time").input_ids
    assert ids[0] != 1 and tok.decode(ids) == "Once upon a time"
    # llama.cpp's "smollm" pre-tokenizer isolates every digit (\p{N}) before the GPT-2 regex.
    pieces = [tok.decode([i]) for i in tok("in 2024 there were 365 days").input_ids]
    assert ["2", "0", "2", "4"] == pieces[pieces.index("2") : pieces.index("2") + 4]
    assert "365" not in pieces and "3" in pieces
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
