"""Sizing against hand-computed tables.

Expectations are written out from the models' config.json numbers and the documented overhead model
(docs/operator.md): `reference()` below is an independent transcription of that arithmetic, and the
literal anchors were computed by hand (the working is in the comments).
"""

import dataclasses
import math

import pytest
from tokenmill.engine.parallel_check import check_parallel_model
from tokenmill.operator.plan.catalog import GPU_TYPES, MODEL_PROFILES, ModelProfile
from tokenmill.operator.plan.sizing import (
    EngineSettings,
    auto_tensor_parallel_sizes,
    plan,
    valid_tensor_parallel_sizes,
)

GiB = 2**30

# name: (params, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_positions)
MODELS = {
    "SmolLM2-135M": (134_515_008, 30, 576, 9, 3, 64, 1536, 49152, 8192),
    "Llama-3.1-8B": (8_030_261_248, 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "Llama-3.1-70B": (70_553_706_496, 80, 8192, 64, 8, 128, 28672, 128256, 131072),
    "Qwen2.5-7B": (7_615_616_512, 28, 3584, 28, 4, 128, 18944, 152064, 32768),
    "Qwen2.5-72B": (72_706_203_648, 80, 8192, 64, 8, 128, 29568, 152064, 32768),
    "Mistral-7B": (7_248_023_552, 32, 4096, 32, 8, 128, 14336, 32768, 32768),
}
# nvidia-smi memory.total in MiB
GPU_MIB = {"nvidia-a10g": 23028, "nvidia-l4": 23034, "nvidia-a100-40gb": 40960, "nvidia-a100-80gb": 81920,
           "nvidia-h100-80gb": 81559, "nvidia-h200-141gb": 143771}


def reference(model: str, gpu: str, tp: int, max_model_len=None, util=0.9, seqs=None, dtype_bytes=2, bs=16):
    """The documented model, transcribed: returns (feasible, kv_blocks, max_model_len, max_num_seqs)."""
    params, layers, hidden, heads, kv, d, inter, vocab, maxpos = MODELS[model]
    usable = math.floor(GPU_MIB[gpu] * 2**20 * util)
    weights = -(-params * dtype_bytes // tp)
    heads_rank, kv_rank = math.ceil(heads / tp), max(1, math.ceil(kv / tp))
    act = math.ceil(3.5 * 2048 * dtype_bytes * (2 * hidden + (heads_rank + 2 * kv_rank) * d + 3 * math.ceil(inter / tp)))
    sampler = (seqs or 256) * vocab * 20
    overhead = 2 * GiB + (GiB // 2 if tp > 1 else 0) + act + sampler
    per_token = 2 * layers * kv_rank * d * dtype_bytes
    budget = usable - weights - overhead
    blocks = max(0, budget) // (bs * per_token)
    if budget < bs * per_token:
        return False, 0, None, None
    tokens = blocks * bs
    mml = max_model_len if max_model_len else (min(maxpos, tokens) // bs) * bs
    if max_model_len and -(-max_model_len // bs) > blocks:
        return False, blocks, mml, None
    if not max_model_len and mml < min(maxpos, 4096):
        return False, blocks, mml, None
    per_seq = -(-max(bs, min(mml, 2048)) // bs)
    return True, blocks, mml, seqs or min(256, max(1, blocks // per_seq))


def test_llama_8b_on_l4_by_hand():
    # usable = floor(0.9 * 23034 MiB) = floor(21,737,609,625.6) = 21,737,609,625
    # weights = 8,030,261,248 x 2 = 16,060,522,496
    # activations = 3.5 x 2048 x 2 x (2x4096 + (32+16)x128 + 3x14336 = 57,344) = 822,083,584
    # sampler = 256 x 128,256 x 20 = 656,670,720; overhead = 2 GiB + both = 3,626,237,952
    # budget = 2,050,849,177; block = 16 x 131,072 = 2,097,152 bytes -> 977 blocks, 15,632 tokens
    p = plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-l4"])
    assert p.feasible and p.reason == "Fits"
    assert p.weights_bytes == 16_060_522_496
    assert p.kv_bytes_per_token == 131_072
    assert p.overhead_bytes == 3_626_237_952
    assert (p.kv_blocks, p.kv_tokens, p.max_model_len) == (977, 15_632, 15_632)
    assert p.max_num_seqs == 977 // 128 == 7
    assert p.kv_cache_bytes == 977 * 2_097_152
    assert p.gpus_per_replica == 1


def test_smollm2_on_l4_by_hand():
    # weights 269,030,016; activations 3.5 x 2048 x 2 x (1152 + 15x64 + 4608 = 6,720) = 96,337,920
    # sampler 256 x 49,152 x 20 = 251,658,240; overhead 2,495,479,808
    # budget 21,737,609,625 - 269,030,016 - 2,495,479,808 = 18,973,099,801; block 16 x 23,040 = 368,640
    p = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-l4"])
    assert p.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert (p.kv_blocks, p.kv_tokens) == (51_467, 823_472)
    assert p.max_model_len == 8192  # the model's limit, not the pool's
    assert p.max_num_seqs == 256


def test_llama_70b_on_eight_l4_by_hand():
    # TP 8: weights/GPU = 141,107,412,992 / 8 = 17,638,426,624; one KV head per rank: 40,960 B/token
    # activations 3.5 x 2048 x 2 x (16384 + (8+2)x128 + 3x3584 = 28,416) = 407,371,776
    # overhead = 2 GiB + 0.5 GiB + 407,371,776 + 656,670,720 = 3,748,397,056
    # budget = 21,737,609,625 - 17,638,426,624 - 3,748,397,056 = 350,785,945 -> 535 blocks of 655,360
    p = plan(MODEL_PROFILES["Llama-3.1-70B"], GPU_TYPES["nvidia-l4"])
    assert p.gpus_per_replica == 8
    assert p.kv_bytes_per_token == 40_960
    assert (p.kv_blocks, p.kv_tokens, p.max_model_len) == (535, 8560, 8560)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("gpu", sorted(GPU_MIB))
def test_table_matches_reference_at_the_fewest_gpus(model, gpu):
    p = plan(MODEL_PROFILES[model], GPU_TYPES[gpu])
    heads, kv = MODELS[model][3], MODELS[model][4]
    candidates = [tp for tp in (1, 2, 4, 8) if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]
    fitting = [tp for tp in candidates if reference(model, gpu, tp)[0]]
    if not fitting:  # no single node fits: infeasible, or a multi-node plan (tests/test_operator_lws.py)
        assert not p.feasible or p.nodes_per_replica > 1
        return
    tp = fitting[0]
    ok, blocks, mml, seqs = reference(model, gpu, tp)
    assert (p.feasible, p.gpus_per_replica, p.kv_blocks, p.max_model_len, p.max_num_seqs) == (ok, tp, blocks, mml, seqs)
    assert p.kv_tokens == blocks * 16


@pytest.mark.parametrize(
    ("model", "gpu", "tp"),
    [("Llama-3.1-8B", "nvidia-a10g", 1), ("Qwen2.5-7B", "nvidia-h100-80gb", 1), ("Llama-3.1-70B", "nvidia-h200-141gb", 2),
     ("Qwen2.5-72B", "nvidia-a100-80gb", 4), ("Mistral-7B", "nvidia-a100-40gb", 2), ("Llama-3.1-70B", "nvidia-a100-40gb", 8)],
)
def test_explicit_gpu_count_matches_reference(model, gpu, tp):
    p = plan(MODEL_PROFILES[model], GPU_TYPES[gpu], gpu_count=tp)
    ok, blocks, mml, seqs = reference(model, gpu, tp)
    assert (p.feasible, p.kv_blocks, p.max_model_len, p.max_num_seqs) == (ok, blocks, mml, seqs)
    assert p.gpus_per_replica == tp


def test_seventy_b_on_one_l4_says_why_and_what_fits():
    p = plan(MODEL_PROFILES["Llama-3.1-70B"], GPU_TYPES["nvidia-l4"], gpu_count=1)
    assert not p.feasible and p.reason == "WeightsDoNotFit"
    # 70,553,706,496 x 2 bytes = 141.1 GB; 23,034 MiB = 24.15 GB
    assert "Llama-3.1-70B in bfloat16 needs 141 GB of weights; 1 x nvidia-l4 has 24.2 GB" in p.message
    # eight L4s fit (test above); among other types the least total memory that fits is 2 x H100
    # (2 x 81,559 MiB < 2 x A100-80GB 81,920 MiB < 2 x H200 < 8 x A100-40GB)
    assert reference("Llama-3.1-70B", "nvidia-h100-80gb", 2)[0]
    assert not reference("Llama-3.1-70B", "nvidia-h100-80gb", 1)[0]
    assert p.message.endswith("use gpu.count 8 or gpu.type nvidia-h100-80gb with count 2")


def test_qwen_72b_does_not_fit_eight_l4():
    # per GPU: 145,412,407,296 / 8 = 18,176,550,912 weights + overhead 3,875,110,912
    # (activations 3.5 x 4096 x (16384 + 10x128 + 3x3696) = 412,188,672; sampler 256 x 152064 x 20)
    # = 22,051,661,824 > 21,737,609,625 usable
    p = plan(MODEL_PROFILES["Qwen2.5-72B"], GPU_TYPES["nvidia-l4"], gpu_count=8)
    assert not p.feasible and p.reason == "WeightsDoNotFit" and p.gpus_per_replica == 8
    assert "18.2 GB per GPU" in p.message
    # Fits elsewhere: 8 x A100-40GB (327,680 MiB), 4 x A100-80GB (327,680), 4 x H100 (326,236) and
    # 2 x H200 (287,542 MiB): the suggestion is the least total memory
    assert reference("Qwen2.5-72B", "nvidia-h200-141gb", 2)[0] and not reference("Qwen2.5-72B", "nvidia-h200-141gb", 1)[0]
    assert not reference("Qwen2.5-72B", "nvidia-h100-80gb", 2)[0]
    # Without gpu.count the operator would plan two L4 nodes (tests/test_operator_lws.py).
    assert p.message.endswith("use no gpu.count (2 nodes x 8 GPUs per replica) or gpu.type nvidia-h200-141gb "
                              "with count 2")


def test_explicit_max_model_len_too_large_for_the_pool():
    settings = EngineSettings(max_model_len=32768)
    p = plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-l4"], settings, gpu_count=1)
    assert not p.feasible and p.reason == "KVCacheTooSmall"
    assert "15632 tokens (977 blocks x 16" in p.message and "maxModelLen 32768 needs 32768" in p.message
    # With the count left to the operator it takes two L4s: 9,438 blocks of 1 MiB at TP 2
    # (budget 21,737,609,625 - 8,030,261,248 - 3,810,787,328 = 9,896,561,049)
    auto = plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-l4"], settings)
    assert auto.feasible and auto.gpus_per_replica == 2 and auto.kv_blocks == 9438
    assert auto.max_model_len == 32768


def test_max_model_len_beyond_the_model():
    p = plan(MODEL_PROFILES["Qwen2.5-7B"], GPU_TYPES["nvidia-h200-141gb"], EngineSettings(max_model_len=65536))
    assert not p.feasible and p.reason == "MaxModelLenTooLarge"
    assert "65536" in p.message and "32768" in p.message


def test_auto_max_model_len_is_block_aligned_and_capped_by_the_model():
    p = plan(MODEL_PROFILES["Mistral-7B"], GPU_TYPES["nvidia-a10g"], EngineSettings(block_size=32))
    _ok, blocks, mml, _ = reference("Mistral-7B", "nvidia-a10g", 1, bs=32)
    assert p.max_model_len == mml and p.max_model_len % 32 == 0 and p.kv_blocks == blocks
    big = plan(MODEL_PROFILES["Mistral-7B"], GPU_TYPES["nvidia-h200-141gb"])
    assert big.max_model_len == 32768 < big.kv_tokens


def test_invalid_gpu_count_lists_the_valid_ones():
    p = plan(MODEL_PROFILES["Qwen2.5-7B"], GPU_TYPES["nvidia-h100-80gb"], gpu_count=8)
    assert not p.feasible and p.reason == "InvalidGPUCount"
    assert "28 attention heads" in p.message and "use 1, 2 or 4" in p.message


def test_bundled_model_at_gpu_count_two_names_its_heads_and_the_counts_that_work():
    p = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-l4"], gpu_count=2)
    assert not p.feasible and p.reason == "InvalidGPUCount"
    assert "gpu.count 2 cannot split SmolLM2-135M evenly" in p.message
    assert "9 attention heads, 3 KV heads, MLP width 1536" in p.message and p.message.endswith("use 1 or 3")


def test_bundled_model_at_gpu_count_three_is_a_tensor_parallel_plan():
    # TP 3: 3 of the 9 heads and 1 of the 3 KV heads per rank: 2 x 30 x 1 x 64 x 2 = 7,680 bytes/token;
    # weights 269,030,016 / 3 = 89,676,672 per GPU
    p = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-l4"], gpu_count=3)
    assert p.feasible and p.reason == "Fits", p.message
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.nodes_per_replica, p.gpus_per_replica) == (3, 1, 1, 3)
    assert p.kv_bytes_per_token == 7_680 and p.weights_bytes_per_gpu == 89_676_672
    ok, blocks, mml, seqs = reference("SmolLM2-135M", "nvidia-l4", 3)
    assert (p.feasible, p.kv_blocks, p.max_model_len, p.max_num_seqs) == (ok, blocks, mml, seqs)


def test_gpu_count_beyond_one_node_is_refused_by_sizing():
    p = plan(MODEL_PROFILES["Llama-3.1-70B"], GPU_TYPES["nvidia-h100-80gb"], gpu_count=16)
    assert not p.feasible and p.reason == "InvalidGPUCount"
    assert "gpu.count 16 is more than the 8 GPUs of one nvidia-h100-80gb node" in p.message
    assert "use 1, 2, 4 or 8" in p.message and "omit gpu.count" in p.message


def _shape(heads, kv, intermediate=2048):
    return ModelProfile("x", 10**9, 4, 1024, heads, kv, 64, intermediate, 32000, 4096)


@pytest.mark.parametrize(
    ("heads", "kv", "intermediate", "valid", "auto"),
    [(9, 3, 1536, [1, 3], [1]), (28, 4, 18944, [1, 2, 4], [1, 2, 4]), (64, 8, 28672, [1, 2, 4, 8], [1, 2, 4, 8]),
     (32, 2, 2048, [1, 2, 4, 8], [1, 2, 4, 8]), (14, 2, 2048, [1, 2], [1, 2]), (12, 12, 2048, [1, 2, 4], [1, 2, 4]),
     (12, 12, 3072, [1, 2, 3, 4, 6], [1, 2, 4]), (40, 8, 2048, [1, 2, 4, 8], [1, 2, 4, 8]),
     (24, 8, 6144, [1, 2, 4, 8], [1, 2, 4, 8]), (6, 6, 1536, [1, 2, 3, 6], [1, 2]), (7, 7, 1400, [1, 7], [1])],
)
def test_tensor_parallel_sizes_split_the_heads_and_auto_tiles_the_node(heads, kv, intermediate, valid, auto):
    # 32 heads / 2 KV heads at TP 4 or 8: each rank gets 8 or 4 query heads and a replica of one KV head.
    # 24 heads / 8 KV heads at TP 3 or 6: the 8 KV heads neither split nor replicate evenly.
    profile = _shape(heads, kv, intermediate)
    assert valid_tensor_parallel_sizes(profile, 8) == valid
    assert auto_tensor_parallel_sizes(profile, 8) == auto


@pytest.mark.parametrize("shape", [(9, 3, 1536), (28, 4, 18944), (12, 12, 3072), (24, 8, 6144), (6, 6, 1536), (7, 7, 1400)])
def test_sizing_accepts_exactly_the_counts_the_engine_accepts(shape):
    """An explicit gpu.count is planned iff the engine's own check (parallel_check.check_parallel_model,
    run by `tokenmill serve` and the engine core) accepts it as --tensor-parallel-size."""
    heads, kv, intermediate = shape
    for count in range(1, 9):
        p = plan(_shape(heads, kv, intermediate), GPU_TYPES["nvidia-h200-141gb"], gpu_count=count)
        try:
            check_parallel_model(count, 1, heads, kv, intermediate, 4)
            engine_ok = True
        except ValueError:
            engine_ok = False
        assert (p.reason != "InvalidGPUCount") == engine_ok, (shape, count, p.message)


def test_auto_sizing_of_a_nine_head_model_spans_nodes_instead_of_tp_three():
    """Auto sizing never picks TP 3 (it would strand 2 of a node's 8 GPUs): the bundled model's shape
    declared as 50B parameters plans PP 2 over two nodes (what e2e/test_multinode.py runs)."""
    big = dataclasses.replace(MODEL_PROFILES["SmolLM2-135M"], num_parameters=50_000_000_000)
    p = plan(big, GPU_TYPES["nvidia-h100-80gb"])
    assert p.feasible, p.message
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.nodes_per_replica) == (1, 2, 2)
    # The same model with TP 3 asked for explicitly fits one node (100 GB / 3 per GPU).
    explicit = plan(big, GPU_TYPES["nvidia-h100-80gb"], gpu_count=3)
    assert explicit.feasible and explicit.nodes_per_replica == 1 and explicit.tensor_parallel_size == 3


def test_explicit_max_num_seqs_raises_the_sampler_overhead():
    small = plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-h100-80gb"], EngineSettings(max_num_seqs=16))
    default = plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-h100-80gb"])
    assert default.overhead_bytes - small.overhead_bytes == (256 - 16) * 128256 * 20
    assert small.max_num_seqs == 16
    _ok, blocks, _, _ = reference("Llama-3.1-8B", "nvidia-h100-80gb", 1, seqs=16)
    assert small.kv_blocks == blocks


def test_float32_doubles_weights_and_kv_bytes():
    p = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-a10g"], EngineSettings(dtype="float32"))
    assert p.dtype == "float32"
    assert p.weights_bytes == 134_515_008 * 4
    assert p.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    _ok, blocks, _, _ = reference("SmolLM2-135M", "nvidia-a10g", 1, dtype_bytes=4)
    assert p.kv_blocks == blocks


def test_an_8bit_kv_cache_counts_its_codes_and_scales():
    """int8 / fp8: one byte per value plus a 4-byte scale per (token, KV head), both K and V, every layer."""
    bf16 = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-l4"])
    for kv in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        p = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-l4"], EngineSettings(kv_cache_dtype=kv))
        assert p.feasible and p.dtype == "bfloat16" and p.kv_cache_dtype == ("fp8_e4m3" if kv == "fp8" else kv)
        assert p.kv_bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12_240
        assert p.weights_bytes == bf16.weights_bytes and p.overhead_bytes == bf16.overhead_bytes
        # the same budget: 18,973,099,801 // (16 x 12,240) = 96,880 blocks against bf16's 51,467 (1.88x)
        assert p.kv_blocks == 96_880 and p.kv_cache_bytes == 96_880 * 16 * 12_240
    # Llama-3.1-8B: head_dim 128, 8 KV heads, 32 layers: 2 x 32 x 8 x 132 = 67,584 bytes (bf16: 131,072)
    p = plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-l4"], EngineSettings(kv_cache_dtype="int8"))
    assert p.kv_bytes_per_token == 67_584 and p.kv_blocks == 2_050_849_177 // (16 * 67_584) == 1896


def test_fp8_kv_cache_needs_a_gpu_with_fp8_and_int8_runs_anywhere():
    for gpu in ("nvidia-a10g", "nvidia-a100-80gb"):
        p = plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES[gpu], EngineSettings(kv_cache_dtype="fp8"), 1)
        assert not p.feasible and p.reason == "KVCacheDtypeUnsupported"
        assert "compute capability 8.9 or newer" in p.message and "use kvCacheDtype int8" in p.message
        assert plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES[gpu], EngineSettings(kv_cache_dtype="int8"), 1).feasible
    for gpu in ("nvidia-l4", "nvidia-h100-80gb", "nvidia-h200-141gb"):
        assert plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES[gpu], EngineSettings(kv_cache_dtype="fp8")).feasible


def test_lower_utilization_leaves_less_kv():
    lo = plan(MODEL_PROFILES["Llama-3.1-8B"], GPU_TYPES["nvidia-a100-80gb"], EngineSettings(gpu_memory_utilization=0.5))
    _ok, blocks, mml, _ = reference("Llama-3.1-8B", "nvidia-a100-80gb", 1, util=0.5)
    assert lo.kv_blocks == blocks and lo.max_model_len == mml
