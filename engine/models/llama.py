"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2, Qwen3) in one module.

The differences are flags on ModelConfig: qkv_bias/o_bias (Qwen2, attention_bias), qk_norm (Qwen3),
rope_scaling (Llama 3), tie_word_embeddings. Inputs are one flattened step: all scheduled tokens of all
sequences in a single [num_tokens] batch, attention through the paged KV cache.

Tensor parallel (ParallelState): each rank builds only its share, Megatron-style. qkv_proj and
gate_up_proj hold whole heads / an even slice of the MLP width (column parallel), o_proj and down_proj
the matching input columns (row parallel) followed by one all-reduce each; the embedding and LM head
hold a slice of the vocabulary. Pipeline parallel: a stage builds only its layers and takes / returns
the hidden state and residual at the stage boundary.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tokenmill.engine.distributed.parallel_state import (
    SINGLE,
    ParallelState,
    kv_head_range,
    layer_range,
    tp_all_reduce,
    tp_gather_vocab,
    vocab_shard,
)
from tokenmill.engine.layers.activation import silu_and_mul
from tokenmill.engine.layers.attention import AttentionMetadata, paged_attention
from tokenmill.engine.layers.cpu_gemm_policy import (
    CPU_PACKED_MAX_ROWS,
    PREPACK_MIN_ROWS,
    bf16_logits_max_rows,
    dense_bf16_max_rows,
    dense_bf16_supported,
)
from tokenmill.engine.layers.layernorm import RMSNorm
from tokenmill.engine.layers.linear import (
    CpuPackedWeight,
    Linear,
    bf16_codes_weight,
    dense_bf16_weight,
    pack_cpu_weight,
    packed_linear,
    prepack_weight,
)
from tokenmill.engine.layers.rotary_embedding import Rope, RotaryEmbedding
from tokenmill.engine.layers.weight_codes import CodesCache
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.models import llama_cpu_decoder
from torch import nn


class LlamaAttention(nn.Module):
    # {"qkv_proj": LoRASlots, "o_proj": LoRASlots} when adapters are enabled (engine/lora/manager.py)
    lora: dict | None = None

    def __init__(self, config: ModelConfig, par: ParallelState = SINGLE) -> None:
        super().__init__()
        self.par = par
        self.num_heads = config.num_attention_heads // par.tp_size
        self.num_kv_heads = len(kv_head_range(config.num_key_value_heads, par.tp_rank, par.tp_size))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
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
        if self.lora is not None:  # the step's adapter rows, before rope (engine/layers/lora.py)
            self.lora["qkv_proj"].add(qkv, hidden)
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
        out = out.view(num_tokens, self.q_size)
        o = self.o_proj(out)
        if self.lora is not None:  # a partial product too under TP: the all-reduce sums it with the base's
            self.lora["o_proj"].add(o, out)
        # Row parallel: each rank's partial product over its heads; the sum is the full projection.
        return tp_all_reduce(o, self.par)


class LlamaMLP(nn.Module):
    lora: dict | None = None  # {"gate_up_proj": ..., "down_proj": ...}: as LlamaAttention.lora

    def __init__(self, config: ModelConfig, par: ParallelState = SINGLE) -> None:
        super().__init__()
        self.par = par
        inter = config.intermediate_size // par.tp_size
        # One GEMM for gate and up: rows [gate | up] (this rank's slice of each).
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return tp_all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))), self.par)
        gate_up = self.gate_up_proj(x)
        self.lora["gate_up_proj"].add(gate_up, x)
        act = silu_and_mul(gate_up)
        down = self.down_proj(act)
        self.lora["down_proj"].add(down, act)
        return tp_all_reduce(down, self.par)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [first, first + rows) of the vocabulary; other ids embed to zero here and
    come from their rank through the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, par: ParallelState = SINGLE) -> None:
        super().__init__()
        self.par = par
        self.first, rows = vocab_shard(vocab_size, par.tp_rank, par.tp_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        # Set (and weight dropped) when a tied LM head's integer blocks stand for the matrix: rows are
        # then rebuilt from the codes (pack_linears_cpu).
        self.packed_cpu: CpuPackedWeight | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.packed_cpu.embedding(input_ids)
        if self.par.tp_group is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(1), 0)
        return tp_all_reduce(hidden, self.par)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelState = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, par)
        self.mlp = LlamaMLP(config, par)
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
    lora_state = None  # LoRAStepState when adapters are enabled (engine/lora/manager.py)

    def __init__(self, config: ModelConfig, par: ParallelState = SINGLE) -> None:
        super().__init__()
        self.par = par
        # The first stage embeds; the last needs the matrix too when the LM head is tied to it.
        needs_embed = par.is_first_stage or (par.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, par) if needs_embed else None
        self.layer_ids = layer_range(config.num_hidden_layers, par.pp_rank, par.pp_size)
        # Only this stage's layers; the loader maps checkpoint layer i to local i - layer_ids.start.
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, par) for _ in self.layer_ids)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if par.is_last_stage else None
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # (KV pool and weights' identity, llama_cpu_decoder's FusedLayers or None): built on the first step that
        # could use it.
        self._fused: tuple[tuple, llama_cpu_decoder.FusedLayers | None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        stage_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage returns the normed hidden state; earlier ones (hidden, residual) for the next."""
        if stage_input is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = stage_input
        rope = self.rotary_emb.for_positions(positions, hidden.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            # The C++ layer loop knows nothing of adapters: a step with adapter rows stays in Python.
            lora_rows = self.lora_state is not None and self.lora_state.active
            if i == 1 and not lora_rows and llama_cpu_decoder.step_fits(hidden, rope, attn_metadata):
                fused = self._fused_weights(kv_caches, hidden.dtype)
                if fused is not None and hidden.shape[0] <= fused.max_rows:  # the rest of the layers in one C++ call
                    hidden, residual = llama_cpu_decoder.run_layers(layer, fused.weights, hidden, residual, rope,
                                                                    attn_metadata, fused.int8_x)
                    break
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _fused_weights(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> llama_cpu_decoder.FusedLayers | None:
        """llama_cpu_decoder's weight list for layers 1.. (built once per KV pool), or None where it cannot run."""
        # A new KV pool, new projection weights (packing replaces them) or int8 activations turned on make a new list.
        packed = self.layers[-1].mlp.down_proj.packed_cpu
        key = (id(kv_caches[0][0]) if kv_caches else None, id(packed), getattr(packed, "int8_x", False), dtype)
        if self._fused is None or self._fused[0] != key:
            ok = llama_cpu_decoder.fused_layers_enabled(dtype) and self.par.tp_size == 1 and len(self.layers) > 1
            weights = llama_cpu_decoder.layer_weights(list(self.layers[1:]), kv_caches[1:], dtype) if ok else None
            self._fused = (key, weights)
        return self._fused[1]


class LlamaForCausalLM(nn.Module):
    """model(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden_size]."""

    def __init__(self, config: ModelConfig, par: ParallelState = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.par = par
        self.model = LlamaModel(config, par)
        # Tied models reuse the embedding matrix as the output projection (no separate parameter).
        self.lm_head = None
        if par.is_last_stage and not config.tie_word_embeddings:
            rows = vocab_shard(config.vocab_size, par.tp_rank, par.tp_size)[1]
            self.lm_head = Linear(config.hidden_size, rows, bias=False)
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_packed_cpu: CpuPackedWeight | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        stage_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, kv_caches, attn_metadata, stage_input)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (only the rows that need a next token) -> fp32 logits [N, vocab]
        (last stage only; with TP every rank of the stage gets the gathered vocabulary)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        packed = self.lm_head_packed_cpu
        if hidden.dtype == torch.float32:
            codes_rows = CPU_PACKED_MAX_ROWS
        else:
            codes_rows = dense_bf16_max_rows() if getattr(packed, "dense", None) is not None else bf16_logits_max_rows()
        if packed is not None and (weight is None or hidden.shape[0] <= codes_rows):
            local = packed.linear(hidden, out_dtype=torch.float32)
        elif self.lm_head_packed is not None and hidden.shape[0] >= PREPACK_MIN_ROWS:
            local = packed_linear(hidden, self.lm_head_packed).float()
        else:
            local = F.linear(hidden, weight).float()
        return tp_gather_vocab(local, self.par, self.config.vocab_size)

    def prepack_linears(self, dense: bool | None = None) -> None:
        """Swap every projection (and the LM head, tied or not) to packed bf16 weights (bf16 CPU): those
        without integer codes to the dense bf16 kernel's panels where it runs (`dense`, by default
        cpu_gemm_policy.dense_bf16_supported), the rest to oneDNN's layout. A tied embedding whose LM head
        is dense reads its rows from the panels (one copy of the matrix)."""
        if dense is None:
            dense = dense_bf16_supported()
        for module in self.model.modules():  # the decoder; the LM head is packed once, below
            if isinstance(module, Linear):
                if dense and module.packed_cpu is None and module.weight is not None and module.weight.dtype == torch.bfloat16:
                    module.pack_dense()
                else:
                    module.prepack()
        if self.par.is_last_stage:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            if weight is None:  # loaded as codes, which serve every batch
                pass
            elif dense and self.lm_head_packed_cpu is None and weight.dtype == torch.bfloat16:
                self.lm_head_packed_cpu = dense_bf16_weight(weight)
                if dense_bf16_max_rows() < 1 << 62:
                    self.lm_head_packed = prepack_weight(weight)
                if self.lm_head is not None:
                    self.lm_head.weight = None
                elif self.par.tp_size == 1:
                    self.model.embed_tokens.packed_cpu, self.model.embed_tokens.weight = self.lm_head_packed_cpu, None
            elif getattr(self.lm_head_packed_cpu, "codes", None) is not None and bf16_logits_max_rows() >= 1 << 62:
                pass  # its codes run every batch (cpu_gemm_policy.bf16_logits_max_rows): no oneDNN copy
            else:
                self.lm_head_packed = prepack_weight(weight)

    def attach_weight_codes(self, cache: CodesCache | None = None) -> None:
        """Before a cast of this fp32 model to bf16 on CPU: keep the integer codes of every projection
        and of the LM head that has them, for small batches (cpu_gemm_policy.bf16_codes_max_rows). The tied
        embedding keeps its matrix: prompts look rows up in it."""
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.attach_codes(cache)
        if self.par.is_last_stage:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.lm_head_packed_cpu = bf16_codes_weight(weight, nibbles=self.lm_head is not None, cache=cache)

    def codes_hooks(self, cache: CodesCache | None = None) -> dict[str, Callable[[torch.Tensor], bool]]:
        """attach_weight_codes one parameter at a time, while a bf16 model streams in from an fp32
        checkpoint (model/loader.py's fp32_hooks): each hook gets its parameter's fp32 value before the
        cast and keeps the codes found in it (a Linear's bias: the fp32 bias the kernel adds)."""
        hooks: dict[str, Callable[[torch.Tensor], bool]] = {}
        for name, module in self.model.named_modules(prefix="model"):
            if isinstance(module, Linear):
                hooks[f"{name}.weight"] = functools.partial(module.attach_codes, cache)
                if module.bias is not None:
                    hooks[f"{name}.bias"] = module.keep_fp32_bias
        if self.par.is_last_stage:
            nibbles = self.lm_head is not None

            def head(weight: torch.Tensor) -> bool:
                self.lm_head_packed_cpu = bf16_codes_weight(weight, nibbles=nibbles, cache=cache)
                return False

            hooks["model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"] = head
        return hooks

    def pack_hooks(self, blocks: bool | None = None, cache: CodesCache | None = None) -> dict[str, Callable[[torch.Tensor], bool]]:
        """pack_linears_cpu one parameter at a time, while an fp32 model streams in: each hook gets its
        just-loaded parameter (the parameter's own storage) and packs it; True when its codes stand for
        it and the loader may free the fp32 copy (model/loader.py)."""
        keep_fp32 = self.par.tp_size > 1
        hooks: dict[str, Callable[[torch.Tensor], bool]] = {}
        for name, module in self.model.named_modules(prefix="model"):
            if isinstance(module, Linear):
                hooks[f"{name}.weight"] = lambda _w, m=module: m.pack_cpu(blocks, keep_fp32, cache)
        if self.par.is_last_stage:
            if self.lm_head is None:

                def tied(_weight: torch.Tensor) -> bool:
                    embed = self.model.embed_tokens
                    self.lm_head_packed_cpu = pack_cpu_weight(embed.weight, blocks, nibbles=False, cache=cache)
                    if self.lm_head_packed_cpu.stands_alone and not keep_fp32:
                        embed.packed_cpu, embed.weight = self.lm_head_packed_cpu, None
                        return True
                    return False

                hooks["model.embed_tokens.weight"] = tied
            else:

                def head(_weight: torch.Tensor) -> bool:
                    dropped = self.lm_head.pack_cpu(blocks, keep_fp32, cache)
                    self.lm_head_packed_cpu = self.lm_head.packed_cpu
                    return dropped

                hooks["lm_head.weight"] = head
        return hooks

    def pack_linears_cpu(self, blocks: bool | None = None, cache: CodesCache | None = None) -> None:
        """Give every projection and the LM head the fp32 CPU kernel's packed weights. Weights found as
        integer blocks or bf16 panels then run every batch from them and their fp32 copies are dropped (a
        tied embedding looks its rows up in them); with tensor parallelism they stay, and batches over
        CPU_PACKED_MAX_ROWS rows run through torch's GEMM as for fp32-panel weights."""
        keep_fp32 = self.par.tp_size > 1
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.pack_cpu(blocks, keep_fp32, cache)
        if self.par.is_last_stage:
            if self.lm_head is None and self.model.embed_tokens.weight is None:
                return  # loaded as codes: lm_head_packed_cpu holds them
            if self.lm_head is None:
                embed = self.model.embed_tokens
                self.lm_head_packed_cpu = pack_cpu_weight(embed.weight, blocks, nibbles=False, cache=cache)
                if self.lm_head_packed_cpu.stands_alone and not keep_fp32:
                    embed.packed_cpu, embed.weight = self.lm_head_packed_cpu, None
            else:
                self.lm_head.pack_cpu(blocks, keep_fp32, cache)
                self.lm_head_packed_cpu = self.lm_head.packed_cpu
