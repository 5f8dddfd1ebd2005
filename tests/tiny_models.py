"""Test helpers: tiny random HF models of every supported architecture, and hand-built paged KV state.

make_tiny_model writes a real HF folder (transformers' config classes + save_pretrained, safetensors)
with the bundled model's tokenizer, so engine tests can run text end to end on a model that is fast
on two CPU cores.
"""

import pathlib
import shutil

import torch
from tokenmill.engine.layers.attention import AttentionMetadata

TINY_ARCHS = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _tiny_config(arch: str, vocab_size: int, hidden_size: int = 64, intermediate_size: int = 128) -> object:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, architectures=["LlamaForCausalLM"])
    if arch == "llama3_rope":
        # original_max_position_embeddings far below the prompt lengths tests use, so every band of
        # the llama3 scaling (kept, smoothed, divided by factor) matters for the output.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(
            **{**common, "tie_word_embeddings": True}, rope_parameters=rope, architectures=["LlamaForCausalLM"]
        )
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None, rope_theta=10000.0, architectures=["MistralForCausalLM"])
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        # head_dim 32 != hidden_size / heads (16): exercises the explicit head_dim path.
        return Qwen3Config(
            **{**common, "tie_word_embeddings": True},
            head_dim=32,
            rope_theta=1000000.0,
            architectures=["Qwen3ForCausalLM"],
        )
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")


def make_tiny_model(
    tmp_path: pathlib.Path,
    arch: str,
    tokenizer_dir: pathlib.Path | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 64,
    intermediate_size: int = 128,
) -> pathlib.Path:
    """A tiny random `arch` model saved as an HF folder under tmp_path; returns the folder.

    The tokenizer is the bundled model's (vocab 49152), copied from tokenizer_dir (default: the
    converted bundled model). With vocab_size given, no tokenizer is written (weights-only tests).
    Weights are scaled up from HF's init (std 0.02) so logits are far from uniform and greedy decoding
    does not hinge on near-ties. With dtype bf16 or fp16 the weights are drawn in fp32 and stored cast
    (config.json's dtype says so), as a Hub repo ships them; the folder is then named tiny-ARCH-DTYPE.
    """
    from tokenmill.engine.model.resolve import resolve_model
    from transformers import AutoModelForCausalLM

    config = _tiny_config(arch, vocab_size or 49152, hidden_size, intermediate_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # non-trivial norm weights, so a missing/misplaced norm shows
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.2)
    suffix = "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    out = pathlib.Path(tmp_path) / f"tiny-{arch}{suffix}"
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    if vocab_size is not None:
        return out
    tokenizer_dir = pathlib.Path(tokenizer_dir) if tokenizer_dir is not None else resolve_model(None)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def make_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]


def build_step(
    block_tables: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
    block_size: int,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and AttentionMetadata for one flattened step, built by hand.

    Sequence i already has num_computed[i] tokens in its blocks block_tables[i] and adds num_new[i]
    tokens this step. Returns (positions [T], metadata).
    """
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    for table, done, new in zip(block_tables, num_computed, num_new, strict=True):
        for pos in range(done, done + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + new)
        seq_lens.append(done + new)
    width = max(len(t) for t in block_tables)
    tables = torch.full((len(block_tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        decode_only=all(n == 1 for n in num_new),
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64), md
