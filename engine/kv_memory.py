"""KV-cache memory math shared by the engine and the operator's sizing.

Dependency-free on purpose (no torch): the operator image imports it. Every number about KV bytes,
blocks and concurrency is computed here and nowhere else.
"""

import math

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

# --kv-cache-dtype (vLLM's flag and names; `auto` is the model's dtype, `fp8` is fp8_e4m3 as in vLLM).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# The 8-bit caches: one byte per code, and beside each (token, KV head) row of head_dim codes its fp32
# scale (kernels/kv_quant.py has the layout and why a scale per token and head).
KV_QUANT_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
KV_SCALE_BYTES = 4
# fp8 caches on CUDA: Triton's fp8 conversions need compute capability 8.9 (Ada, Hopper) and up; int8 runs on
# any GPU. The engine refuses (worker/device.py) and the operator's sizing refuses (plan/sizing.py) the same.
FP8_MIN_CUDA_CAPABILITY = (8, 9)


def kv_cache_dtype_fits_gpu(kv_cache_dtype: str, compute_capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability runs a cache of this (resolved) dtype."""
    return not kv_cache_dtype.startswith("fp8") or compute_capability >= FP8_MIN_CUDA_CAPABILITY


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", "float16")."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {sorted(DTYPE_BYTES)}") from None


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The KV cache's dtype for a model served in `dtype`: `auto` is `dtype`, `fp8` is `fp8_e4m3`; a 16/32-bit
    name must be `dtype` itself (the kernels read the cache in the model's dtype or as 8-bit codes)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "fp8":
        return "fp8_e4m3"
    if kv_cache_dtype not in KV_QUANT_DTYPES and kv_cache_dtype != dtype:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} with a model served in {dtype}: a 16/32-bit KV cache is the model's "
            f"dtype; use auto, or an 8-bit cache ({', '.join(KV_QUANT_DTYPES)}, fp8)"
        )
    return kv_cache_dtype


def kv_row_bytes(head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one (token, KV head) row of K or V in a cache of that (resolved) dtype, scale included."""
    if kv_cache_dtype in KV_QUANT_DTYPES:
        return head_dim + KV_SCALE_BYTES
    return head_dim * dtype_bytes(kv_cache_dtype)


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel: int) -> int:
    """Each rank holds num_kv_heads / TP heads; when TP exceeds the KV heads they are replicated, so a
    rank never holds less than one head."""
    return max(1, math.ceil(num_kv_heads / tensor_parallel))


def layers_per_stage(num_layers: int, pipeline_parallel: int) -> int:
    """Layers on the largest pipeline stage (stages take contiguous ranges, the first ones one more)."""
    return math.ceil(num_layers / pipeline_parallel)


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """K and V for one token on one GPU (rank) of a TP x PP replica: its stage's layers, its KV heads, in a
    cache of `kv_cache_dtype` (resolved: resolve_kv_cache_dtype; the model's dtype when the cache is auto).

    The engine sizes every rank's pool with this, and the operator's per-GPU sizing reads the same
    function, so both report the same capacity for the same config.
    """
    layers = layers_per_stage(num_layers, pipeline_parallel)
    return 2 * layers * kv_heads_per_rank(num_kv_heads, tensor_parallel) * kv_row_bytes(head_dim, kv_cache_dtype)


def kv_bytes_per_block(kv_bytes_token: int, block_size: int) -> int:
    return kv_bytes_token * block_size


def num_kv_blocks(budget_bytes: float, block_size: int, kv_bytes_token: int) -> int:
    """How many whole blocks fit in a byte budget (0 when the budget is negative)."""
    if budget_bytes <= 0:
        return 0
    return int(budget_bytes // kv_bytes_per_block(kv_bytes_token, block_size))


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def align_down(value: int, multiple: int) -> int:
    return (value // multiple) * multiple


def max_concurrency(kv_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many sequences of max_model_len tokens fit in the pool at once."""
    if max_model_len <= 0:
        return 0.0
    return kv_blocks / blocks_for_tokens(max_model_len, block_size)


# --- Non-KV GPU memory: the overhead model the operator's sizing uses (and the engine may reuse) ---
# Published measurements this model is fitted to (docs/operator.md, "The overhead model"):
# llm-d measured 4.8 GiB (Llama-3.1-8B) to 7.4 GiB (70B) of activations on H100 with vLLM at an
# 8192-token batch, plus 0.15-0.6 GiB outside torch; KAITO's 2.3 GiB + 5% of weights crash-looped.
# A constant alone cannot cover both, so the model has a constant part and a part that grows with the
# step's token budget, the model's width and the vocabulary.

GIB = 1 << 30
# CUDA context and allocations outside torch (up to 0.6 GiB measured), cuBLAS/cuBLASLt workspaces
# and the memory pool of the captured decode CUDA graphs.
RUNTIME_OVERHEAD_BYTES = 2 * GIB
# NCCL communicators and their buffers, per GPU, when a replica spans several GPUs.
TENSOR_PARALLEL_OVERHEAD_BYTES = GIB // 2
# Peak live activations over the minimum tensors of one forward: transient copies (fp32 upcasts in
# norms and softmax, attention workspaces) and allocator fragmentation. Fitted to the llm-d points.
ACTIVATION_FACTOR = 3.5
# fp32 logits, fp32 probabilities and the top-p/top-k sort (fp32 values + int64 indices).
SAMPLER_BYTES_PER_LOGIT = 20


def weights_bytes(num_parameters: int, dtype: str, tensor_parallel: int = 1) -> int:
    """Weight bytes on one GPU: every linear layer and the vocabulary are split across the TP ranks."""
    return -(-num_parameters * dtype_bytes(dtype) // tensor_parallel)


def activation_peak_bytes(
    max_num_batched_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    tensor_parallel: int = 1,
) -> int:
    """Peak activation bytes of one forward over a full token budget, on one GPU.

    Per token the step holds the residual stream and its normed copy (2 x hidden, on every rank), the
    fused QKV output (this rank's heads) and the MLP's fused gate/up output plus the activated product
    (3 x intermediate / TP), times ACTIVATION_FACTOR for transients.
    """
    tp = tensor_parallel
    heads_per_rank = math.ceil(num_attention_heads / tp) + 2 * max(1, math.ceil(num_kv_heads / tp))
    elements_per_token = 2 * hidden_size + heads_per_rank * head_dim + 3 * math.ceil(intermediate_size / tp)
    return math.ceil(ACTIVATION_FACTOR * max_num_batched_tokens * dtype_bytes(dtype) * elements_per_token)


def sampler_peak_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The sampler's buffers for one step: a full-vocabulary row per running sequence."""
    return max_num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT


def non_kv_overhead_bytes(activation_bytes: int, sampler_bytes: int, tensor_parallel: int = 1) -> int:
    """Everything on one GPU besides weights and the KV cache."""
    tp_bytes = TENSOR_PARALLEL_OVERHEAD_BYTES if tensor_parallel > 1 else 0
    return RUNTIME_OVERHEAD_BYTES + tp_bytes + activation_bytes + sampler_bytes


def kv_cache_budget_bytes(
    gpu_memory_bytes: int, gpu_memory_utilization: float, weights_per_gpu: int, overhead_bytes: int
) -> int:
    """Bytes left for the KV cache on one GPU (negative when weights and overhead do not fit)."""
    return math.floor(gpu_memory_bytes * gpu_memory_utilization) - weights_per_gpu - overhead_bytes
