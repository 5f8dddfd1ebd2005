"""The sizing plan: does a model fit a GPU type, on how many GPUs and nodes, with how much KV cache.

One function, `plan`, decides everything; the operator (pod spec, quota check, status) and
`tokenmill size` all read its result. The memory math itself lives in tokenmill.engine.kv_memory.
A replica that needs more GPUs than one node has runs on several nodes, one pod per node: tensor
parallel inside a node, pipeline parallel across nodes (vLLM's recommendation; NVLink inside, the
slower network only between stages).
"""

from dataclasses import asdict, dataclass, replace

from tokenmill.engine import kv_memory as kvm
from tokenmill.engine import load_memory as lm
from tokenmill.engine import quant_memory
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.lora_memory import lora_slot_bytes
from tokenmill.engine.parallel_check import tp_fits_model
from tokenmill.operator.plan.catalog import GPU_TYPES, GPUType, ModelProfile, profile_config

# Tensor parallel stays inside one node: eight GPUs is the largest node shape in the catalog's clouds.
MAX_TENSOR_PARALLEL_SIZE = 8
# Pipeline stages (nodes) per replica: each stage adds a network hop per step and a pipeline bubble;
# four 8-GPU nodes already hold a 405B model in bfloat16 on 40 GB GPUs.
MAX_NODES_PER_REPLICA = 4
# vLLM's default on GPUs: beyond this a decode step is compute-bound and every sequence slows down.
MAX_NUM_SEQS_CAP = 256
# A typical chat turn (prompt + answer) for `maxNumSeqs: auto`: how many of these fit in the KV cache.
REFERENCE_SEQUENCE_TOKENS = 2048
# `maxModelLen: auto` must leave room for at least this much context (or the model's limit if smaller),
# otherwise a bigger GPU or more GPUs is the better answer than a model that cannot hold a prompt.
MIN_AUTO_MAX_MODEL_LEN = 4096
# The engine's per-step token budget is its default (the server has no flag for it).
MAX_NUM_BATCHED_TOKENS = EngineConfig().max_num_batched_tokens


@dataclass(frozen=True, slots=True)
class EngineSettings:
    dtype: str = "auto"  # auto = bfloat16 on GPUs
    kv_cache_dtype: str = "auto"  # the engine's --kv-cache-dtype: auto = dtype; int8, fp8 (e4m3), fp8_e5m2
    block_size: int = 16
    max_model_len: int | None = None  # None = auto
    max_num_seqs: int | None = None  # None = auto
    gpu_memory_utilization: float = 0.9
    # spec.model.lora: adapter slots (--max-loras) of rank --max-lora-rank; 0: no adapters
    max_loras: int = 0
    max_lora_rank: int = 0


@dataclass(frozen=True, slots=True)
class SizingPlan:
    model: str
    gpu_type: str
    feasible: bool
    reason: str  # Fits | WeightsDoNotFit | KVCacheTooSmall | MaxModelLenTooLarge | InvalidGPUCount | KVCacheDtypeUnsupported
    message: str
    dtype: str
    kv_cache_dtype: str  # resolved (kv_memory.resolve_kv_cache_dtype): what each KV byte count below is of
    gpus_per_replica: int  # every GPU of every pod of one replica: TP x PP
    tensor_parallel_size: int  # GPUs per pod (inside one node)
    pipeline_parallel_size: int  # stages, one pod (node) each
    nodes_per_replica: int  # pods per replica; > 1 runs the replica as a LeaderWorkerSet group
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int  # the whole model
    weights_bytes_per_gpu: int  # the largest pipeline stage's share
    overhead_bytes: int  # per GPU: runtime + activations + sampler
    kv_cache_bytes: int  # per GPU, what the engine is told to allocate (whole blocks)
    kv_bytes_per_token: int  # per GPU (this rank's heads of the largest stage's layers)
    block_size: int
    kv_blocks: int
    kv_tokens: int  # per replica
    max_model_len: int
    max_num_seqs: int
    max_position_embeddings: int
    target_queue_depth: int  # waiting + running requests one replica serves without queueing
    host_memory_bytes: int  # per pod: what its processes hold at the load's peak (load_memory.py)
    lora_slot_bytes: int = 0  # per GPU: the LoRA adapter slots (engine/lora_memory.py), left out of the KV budget

    def to_dict(self) -> dict:
        return asdict(self)

    def with_reason(self, reason: str, message: str) -> "SizingPlan":
        return replace(self, feasible=False, reason=reason, message=message)


def resolve_dtype(dtype: str) -> str:
    resolved = "bfloat16" if dtype == "auto" else dtype
    kvm.dtype_bytes(resolved)  # raises ValueError naming the supported dtypes
    return resolved


def valid_tensor_parallel_sizes(profile: ModelProfile, max_size: int = MAX_TENSOR_PARALLEL_SIZE) -> list[int]:
    """Every tensor parallel size up to one node that the engine can split the model by: its own rule
    (parallel_check.tp_fits_model: heads and MLP width divide, KV heads split or replicated), so the
    operator never plans a TP the engine refuses. An explicit gpu.count may be any of these."""
    p = profile
    if p.quantization:  # AWQ / GPTQ: the engine loads them without tensor parallelism (quant_memory.check_int4_parallel)
        return [1]
    return [
        tp for tp in range(1, min(max_size, MAX_TENSOR_PARALLEL_SIZE) + 1)
        if tp_fits_model(p.num_attention_heads, p.num_key_value_heads, p.intermediate_size, tp)
    ]  # fmt: skip


def auto_tensor_parallel_sizes(profile: ModelProfile, gpus_per_node: int) -> list[int]:
    """The sizes automatic sizing tries: the valid ones that divide a node's GPUs (1, 2, 4, 8 on 8-GPU
    nodes). Replicas then tile a node with no GPU left stranded (three TP-3 pods leave 2 of 8 idle), and
    they match the NVLink/NVSwitch partitions and NCCL rings that GPU nodes are built around."""
    return [tp for tp in valid_tensor_parallel_sizes(profile, gpus_per_node) if gpus_per_node % tp == 0]


def layouts(profile: ModelProfile, gpu: GPUType) -> list[tuple[int, int]]:
    """(tensor parallel, pipeline parallel) candidates, fewest GPUs first: one node with each automatic
    TP, then 2..MAX_NODES_PER_REPLICA nodes with the largest automatic TP (the node's GPUs, or the most
    of them the model splits by)."""
    single = auto_tensor_parallel_sizes(profile, gpu.gpus_per_node)
    stages = range(2, min(MAX_NODES_PER_REPLICA, profile.num_hidden_layers) + 1)
    return [(tp, 1) for tp in single] + [(single[-1], pp) for pp in stages]


def gpus_per_replica(plan: SizingPlan) -> int:
    """The GPUs one replica requests, all its pods together: read by the pod spec (through gpus_per_pod),
    the quota check and the status alike."""
    return plan.gpus_per_replica


def gpus_per_pod(plan: SizingPlan) -> int:
    """nvidia.com/gpu of each pod of a replica (one pod per node)."""
    return gpus_per_replica(plan) // plan.nodes_per_replica


def layers_per_stage(profile: ModelProfile, pp: int) -> int:
    """Decoder layers on the largest pipeline stage (vLLM gives the remainder to middle stages)."""
    return -(-profile.num_hidden_layers // pp)


def stage_parameters(profile: ModelProfile, pp: int) -> int:
    """Parameters of the largest pipeline stage: its layers plus one vocabulary matrix (the embedding on
    the first stage, the LM head and final norm on the last; a tied embedding is held by both)."""
    if pp == 1:
        return profile.num_parameters
    vocab = profile.vocab_size * profile.hidden_size
    embeddings = vocab * (1 if profile.tie_word_embeddings else 2)
    layers = max(0, profile.num_parameters - embeddings - profile.hidden_size)
    per_layer = -(-layers // profile.num_hidden_layers)
    return per_layer * layers_per_stage(profile, pp) + vocab + profile.hidden_size


def plan(
    profile: ModelProfile, gpu: GPUType, settings: EngineSettings = EngineSettings(), gpu_count: int | None = None
) -> SizingPlan:
    """Size `profile` on `gpu`; gpu_count None picks the fewest GPUs that fit."""
    dtype = resolve_dtype(settings.dtype)
    valid = valid_tensor_parallel_sizes(profile, gpu.gpus_per_node)  # what an explicit gpu.count may be
    if settings.max_model_len is not None and settings.max_model_len > profile.max_position_embeddings:
        return _plan_at(profile, gpu, settings, dtype, gpu_count or valid[0]).with_reason(
            "MaxModelLenTooLarge",
            f"maxModelLen {settings.max_model_len} exceeds what {profile.name} supports "
            f"({profile.max_position_embeddings} positions): set maxModelLen to at most "
            f"{profile.max_position_embeddings} or auto",
        )
    if gpu_count is not None and gpu_count > gpu.gpus_per_node:
        return _plan_at(profile, gpu, settings, dtype, gpu_count).with_reason(
            "InvalidGPUCount",
            f"gpu.count {gpu_count} is more than the {gpu.gpus_per_node} GPUs of one {gpu.name} node (a "
            f"replica's tensor parallel group stays on one node): use {_or_list(valid)}, or omit gpu.count "
            "to let a replica span nodes",
        )
    if gpu_count is not None and gpu_count > 1 and profile.quantization:
        return _plan_at(profile, gpu, settings, dtype, gpu_count).with_reason(
            "InvalidGPUCount",
            f"gpu.count {gpu_count}: {profile.name} is a {profile.quantization} int4 checkpoint, which the engine "
            "loads without tensor parallelism: use gpu.count 1, or omit gpu.count to let a replica span nodes "
            "(one GPU per pipeline stage)",
        )
    if gpu_count is not None and gpu_count not in valid:
        return _plan_at(profile, gpu, settings, dtype, gpu_count).with_reason(
            "InvalidGPUCount",
            f"gpu.count {gpu_count} cannot split {profile.name} evenly ({profile.num_attention_heads} attention "
            f"heads, {profile.num_key_value_heads} KV heads, MLP width {profile.intermediate_size}; each "
            f"tensor parallel rank needs whole heads): use {_or_list(valid)}",
        )
    last = None
    for tp, pp in [(gpu_count, 1)] if gpu_count is not None else layouts(profile, gpu):
        candidate = _plan_at(profile, gpu, settings, dtype, tp, pp)
        if candidate.feasible:
            return candidate
        last = candidate
    hint = suggest(profile, gpu, settings, exclude=(gpu.name, last.gpus_per_replica))
    return replace(last, message=f"{last.message}: {hint}")


def suggest(profile: ModelProfile, gpu: GPUType, settings: EngineSettings, exclude: tuple[str, int]) -> str:
    """What would fit instead: more GPUs of this type, or the smallest other type that fits."""
    options = []
    for other in sorted(GPU_TYPES.values(), key=lambda g: g.memory_mib):
        for tp, pp in layouts(profile, other):
            if (other.name, tp * pp) == exclude:
                continue
            p = _plan_at(profile, other, settings, resolve_dtype(settings.dtype), tp, pp)
            if p.feasible:
                options.append((tp * pp * other.memory_mib, other.name, tp, pp))
                break
    same = [o for o in options if o[1] == gpu.name and o[2] * o[3] > exclude[1]]
    others = sorted(o for o in options if o[1] != gpu.name)[:1]

    def word(option: tuple, same_type: bool) -> str:
        _, name, tp, pp = option
        if pp > 1:  # only the automatic choice (no gpu.count) spans nodes
            nodes = f"{pp} nodes x {tp} GPUs per replica"
            return f"no gpu.count ({nodes})" if same_type else f"gpu.type {name} without a count ({nodes})"
        return f"gpu.count {tp}" if same_type else f"gpu.type {name} with count {tp}"

    words = [word(o, True) for o in same] + [word(o, False) for o in others]
    if not words:
        return (
            f"no catalog GPU type fits it in {MAX_NODES_PER_REPLICA} nodes per replica; lower maxModelLen or "
            "use a smaller model or dtype"
        )
    return "use " + " or ".join(words)


def _plan_at(
    profile: ModelProfile, gpu: GPUType, settings: EngineSettings, dtype: str, tp: int, pp: int = 1
) -> SizingPlan:
    bs = settings.block_size
    weights = held_weights_bytes(profile, dtype)
    weights_gpu = -(-weights * stage_parameters(profile, pp) // profile.num_parameters // tp)
    seqs_for_overhead = settings.max_num_seqs or MAX_NUM_SEQS_CAP
    activations = kvm.activation_peak_bytes(
        MAX_NUM_BATCHED_TOKENS, profile.hidden_size, profile.intermediate_size, profile.num_attention_heads,
        profile.num_key_value_heads, profile.head_dim, dtype, tp,
    )
    # Communication buffers are needed whenever the replica spans several GPUs (TP or PP); the sampler is
    # counted on every stage, which is conservative for all but the last.
    sampler = kvm.sampler_peak_bytes(seqs_for_overhead, profile.vocab_size)
    overhead = kvm.non_kv_overhead_bytes(activations, sampler, tp * pp)
    lora = 0
    if settings.max_loras:  # the engine's own function: its slots are allocated before its KV pool is sized
        lora = lora_slot_bytes(
            profile.num_hidden_layers, profile.hidden_size, profile.num_attention_heads, profile.num_key_value_heads,
            profile.head_dim, profile.intermediate_size, settings.max_loras, settings.max_lora_rank, dtype, tp, pp,
        )  # fmt: skip
    budget = kvm.kv_cache_budget_bytes(
        gpu.memory_bytes, settings.gpu_memory_utilization, weights_gpu, overhead + lora
    )
    kv_dtype = kvm.resolve_kv_cache_dtype(settings.kv_cache_dtype, dtype)
    per_token = kvm.kv_bytes_per_token(
        layers_per_stage(profile, pp), profile.num_key_value_heads, profile.head_dim, kv_dtype, tp
    )
    blocks = kvm.num_kv_blocks(budget, bs, per_token)
    tokens = blocks * bs
    limit = kvm.align_down(profile.max_position_embeddings, bs)
    if settings.max_model_len is not None:
        max_model_len = settings.max_model_len
    else:
        max_model_len = kvm.align_down(min(limit, tokens), bs)
    concurrency = blocks // kvm.blocks_for_tokens(max(bs, min(max_model_len, REFERENCE_SEQUENCE_TOKENS)), bs)
    max_num_seqs = settings.max_num_seqs or min(MAX_NUM_SEQS_CAP, max(1, concurrency))
    result = SizingPlan(
        model=profile.name, gpu_type=gpu.name, feasible=True, reason="Fits", message="", dtype=dtype,
        kv_cache_dtype=kv_dtype, gpus_per_replica=tp * pp, tensor_parallel_size=tp, pipeline_parallel_size=pp, nodes_per_replica=pp,
        gpu_memory_bytes=gpu.memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization, weights_bytes=weights,
        weights_bytes_per_gpu=weights_gpu, overhead_bytes=overhead, kv_cache_bytes=blocks * bs * per_token,
        kv_bytes_per_token=per_token, block_size=bs, kv_blocks=blocks, kv_tokens=tokens,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_position_embeddings=profile.max_position_embeddings,
        target_queue_depth=max(1, min(max_num_seqs, concurrency)),
        # Each rank also keeps CPU_LORAS_PER_SLOT x maxAdapters adapters in host memory (their slot layout).
        host_memory_bytes=host_memory_bytes(profile, tp) + tp * CPU_LORAS_PER_SLOT * lora,
        lora_slot_bytes=lora,
    )
    usable = budget + weights_gpu + overhead
    where = f"{tp} x {gpu.name}" if pp == 1 else f"{pp} nodes x {tp} x {gpu.name} (TP {tp} x PP {pp})"
    many = tp * pp > 1
    if not kvm.kv_cache_dtype_fits_gpu(kv_dtype, gpu.compute_capability):
        have, need = gpu.compute_capability, kvm.FP8_MIN_CUDA_CAPABILITY
        return result.with_reason(
            "KVCacheDtypeUnsupported",
            f"kvCacheDtype {settings.kv_cache_dtype} ({kv_dtype}) needs fp8 conversions, compute capability "
            f"{need[0]}.{need[1]} or newer; {gpu.name} is {have[0]}.{have[1]}: use kvCacheDtype int8 (half the bytes "
            "too) or auto",
        )
    if budget < bs * per_token:
        per_gpu = f" ({gb(weights_gpu)} per GPU)" if many else ""
        return result.with_reason(
            "WeightsDoNotFit",
            f"{profile.name} in {dtype} needs {gb(weights)} of weights{per_gpu}; {where} "
            f"{'have' if many else 'has'} {gb(gpu.memory_bytes)}{' each' if many else ''} ({gb(usable)} at gpuMemoryUtilization "
            f"{settings.gpu_memory_utilization:g}, {gb(overhead)} of it runtime and activation overhead)",
        )
    needed = kvm.blocks_for_tokens(max_model_len, bs)
    floor = min(limit, MIN_AUTO_MAX_MODEL_LEN)
    if settings.max_model_len is not None and needed > blocks:
        return result.with_reason(
            "KVCacheTooSmall",
            f"{where} leaves {gb(budget)} per GPU for {profile.name}'s KV cache after {gb(weights_gpu)} of "
            f"weights and {gb(overhead)} of overhead{_lora_words(lora)}: {tokens} tokens ({blocks} blocks x {bs}, "
            f"{per_token} bytes/token); maxModelLen {max_model_len} needs {needed * bs}",
        )
    if settings.max_model_len is None and max_model_len < floor:
        return result.with_reason(
            "KVCacheTooSmall",
            f"{where} leaves {gb(budget)} per GPU for {profile.name}'s KV cache after {gb(weights_gpu)} of "
            f"weights and {gb(overhead)} of overhead{_lora_words(lora)}: {tokens} tokens, under the {floor} that "
            f"maxModelLen auto needs",
        )
    return replace(
        result,
        message=(
            f"{where} per replica: {gb(weights_gpu)} weights + {gb(overhead)} overhead + "
            + (f"{gb(lora)} LoRA slots ({settings.max_loras} adapters of rank {settings.max_lora_rank}) + " if lora else "")
            + f"{gb(result.kv_cache_bytes)} "
            f"KV cache per GPU; {tokens} KV tokens ({blocks} blocks x {bs}), maxModelLen {max_model_len}, "
            f"maxNumSeqs {max_num_seqs}"
        ),
    )


def held_weights_bytes(profile: ModelProfile, dtype: str) -> int:
    """The whole model's weights as an engine on a GPU holds them: the engine's own count
    (engine/quant_memory.py, which its plan and `serve --check` print), so both size a quantized model
    alike. An AWQ / GPTQ model is dequantized to `dtype` on a GPU (no GPU codes kernels yet), so its
    bytes are its parameters', counted from its shape rather than from its packed int32 tensors."""
    if not profile.quantization:
        return kvm.weights_bytes(profile.num_parameters, dtype)
    codes = quant_memory.codes_held("cuda", dtype, 1, bf16_dot=False)
    return quant_memory.config_weights(profile_config(profile), dtype, codes).loaded_bytes


def weights_from(profile: ModelProfile, dtype: str, model_uri: str) -> str:
    """status.sizing.weightsFrom: how weightsBytes was counted, in words."""
    per = kvm.dtype_bytes(dtype)
    if profile.quantization:
        return (
            f"{profile.quantization}: int4 projections (config.json's quantization_config), dequantized to {dtype} "
            f"at load on a GPU (no GPU int4 kernels yet): {profile.num_parameters} weights counted from the "
            f"shape x {per} bytes (engine/quant_memory.config_weights, as serve --check counts them)"
        )
    count = f"{profile.num_parameters} parameters ({profile.source}) x {per} bytes ({dtype})"
    if model_uri.partition("@")[0].lower().endswith(".gguf") or model_uri.startswith("bundled://"):
        return (
            f"a GGUF file, dequantized to {dtype} at load on a GPU (no GPU kernels for its blocks yet): {count}; "
            "the operator does not read the file (serve --check counts its header)"
        )
    return count


# The engine's --max-cpu-loras per adapter slot (children/lora_config.py passes it): host memory for twice
# the slots, so a request for an adapter beyond the running ones queues for a slot instead of being refused.
CPU_LORAS_PER_SLOT = 2


def _lora_words(lora_bytes: int) -> str:
    return f" and {gb(lora_bytes)} of LoRA adapter slots" if lora_bytes else ""


def host_memory_bytes(profile: ModelProfile, ranks_per_pod: int) -> int:
    """A pod's host memory at its load's peak: the API server and, per rank (one per GPU of the pod), the
    process and one checkpoint tensor read on the host before its copy to the GPU (the engine streams
    weights one tensor at a time: engine/load_memory.py), the largest one, stored in fp32 at worst."""
    p = profile
    largest = lm.largest_tensor_elements(
        p.vocab_size, p.hidden_size, p.intermediate_size, p.num_attention_heads, p.head_dim
    ) * lm.CHECKPOINT_ELEMENT_BYTES
    return lm.gpu_pod_host_bytes(ranks_per_pod, largest)


def gb(num_bytes: float) -> str:
    """Decimal gigabytes as GPU vendors print them: 141 GB, 24.2 GB, 0.27 GB."""
    value = num_bytes / 1e9
    if abs(value) >= 100:
        return f"{value:.0f} GB"
    if abs(value) >= 1:
        return f"{value:.1f} GB"
    return f"{value:.2f} GB"


def _or_list(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
