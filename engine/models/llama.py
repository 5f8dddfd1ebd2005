"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2, Qwen3) in one module.

The differences are flags on ModelConfig: qkv_bias/o_bias (Qwen2, attention_bias), qk_norm (Qwen3),
rope_scaling (Llama 3), tie_word_embeddings. Inputs are one flattened step: all scheduled tokens of all
sequences in a single [num_tokens] batch, attention through the paged KV cache.
"""

import torch
import torch.nn.functional as F
from tokenmill.engine.attention import AttentionMetadata, paged_attention
from tokenmill.engine.layers import (
    PREPACK_MIN_ROWS,
    Linear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    packed_linear,
    prepack_weight,
    silu_and_mul,
)
from tokenmill.engine.model_config import ModelConfig
from torch import nn


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = self.head_dim**-0.5
        # One GEMM for q, k and v: rows [q | k | v], the loader writes each HF projection into its slice.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if not self.qk_norm and not rope.gathered:
            # q and k heads sit side by side in each qkv row: one in-place call rotates both.
            heads = self.num_heads + self.num_kv_heads
            rope.apply(qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim))
        else:
            q = rope.apply(q)
            k = rope.apply(k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], attn_metadata, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # One GEMM for gate and up: rows [gate | up].
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.for_positions(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """model(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden_size]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models reuse the embedding matrix as the output projection (no separate parameter).
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head_packed: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (only the rows that need a next token) -> fp32 logits [N, vocab]."""
        if self.lm_head_packed is not None and hidden.shape[0] >= PREPACK_MIN_ROWS:
            return packed_linear(hidden, self.lm_head_packed).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def prepack_linears(self) -> None:
        """Swap every projection (and the LM head, tied or not) to oneDNN-prepacked weights (bf16 CPU)."""
        for module in self.model.modules():  # the decoder; the LM head is packed once, below
            if isinstance(module, Linear):
                module.prepack()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head_packed = prepack_weight(weight)
