"""Status fields that are not conditions: timestamps, status.sizing from a plan, and the capacity the
engines measured (carried over while it describes the current generation, with its first event)."""

import datetime

from tokenmill.operator.plan.catalog import ModelProfile
from tokenmill.operator.plan.sizing import SizingPlan, gpus_per_replica


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def plan_status(p: SizingPlan, profile: ModelProfile | None) -> dict:
    return {
        "model": p.model,
        "profileSource": profile.source if profile else "",
        "feasible": p.feasible,
        "reason": p.reason,
        "message": p.message,
        "gpuType": p.gpu_type,
        "gpusPerReplica": gpus_per_replica(p),
        "nodesPerReplica": p.nodes_per_replica,
        "tensorParallelSize": p.tensor_parallel_size,
        "pipelineParallelSize": p.pipeline_parallel_size,
        "dtype": p.dtype,
        "gpuMemoryBytes": p.gpu_memory_bytes,
        "weightsBytes": p.weights_bytes,
        "weightsBytesPerGPU": p.weights_bytes_per_gpu,
        "overheadBytes": p.overhead_bytes,
        "kvCacheBytes": p.kv_cache_bytes,
        "kvBytesPerToken": p.kv_bytes_per_token,
        "blockSize": p.block_size,
        "kvBlocks": p.kv_blocks,
        "kvTokens": p.kv_tokens,
        "maxModelLen": p.max_model_len,
        "maxNumSeqs": p.max_num_seqs,
        "targetQueueDepth": p.target_queue_depth,
    }


def keep_measured(previous: dict, status: dict, generation: int) -> None:
    """Carry the last measurement over while it describes the current generation's pods."""
    old = (previous.get("sizing") or {}).get("measured")
    if old and previous.get("observedGeneration") == generation and "sizing" in status:
        status["sizing"]["measured"] = old


def capacity_event(sizing: SizingPlan, measured: dict) -> tuple[str, str, str]:
    tokens = measured.get("kvTokens")
    text = f"engines report {tokens} KV tokens per replica (estimate {sizing.kv_tokens})"
    if tokens and abs(tokens - sizing.kv_tokens) > 0.05 * sizing.kv_tokens:
        return ("Warning", "CapacityMismatch", text + ": the model profile may not match the weights")
    return ("Normal", "CapacityMeasured", text)
