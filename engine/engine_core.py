"""EngineCore: scheduler + KV cache manager + model runner, one step at a time.

Runs in its own process behind the server (see core_proc.py) or in-process for tests and the offline
LLM. It sees token ids only: tokenization, detokenization and stop strings live upstream.
"""

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from tokenmill.engine import block_cache, kv_memory, weight_blocks
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine_capacity import EngineCapacity, StartupTimer
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.layers import bf16_codes_wanted, cpu_linear_mode
from tokenmill.engine.model_config import ModelConfig, load_model_config
from tokenmill.engine.model_loader import checkpoint_is_float32, load_model, resolve_dtype, resolve_model
from tokenmill.engine.outputs import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tokenmill.engine.parallel_executor import LeaderGroup, agree_num_kv_blocks, make_runner, start_leader
from tokenmill.engine.parallel_state import SINGLE, validate_parallel
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_input import max_packed_len
from tokenmill.engine.structured_output_manager import StructuredOutputManager, accept_token
from tokenmill.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

# Default KV pool on CPU when neither num_kv_blocks nor kv_cache_memory is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# On CUDA the pool takes this fraction of the memory left free after loading the weights.
CUDA_KV_CACHE_FRACTION = 0.9


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counters behind LLM.stats() and the benchmarks."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hit_tokens: int = 0
    sum_running_seqs: int = 0
    sum_kv_utilization: float = 0.0


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu' or 'cuda'")
    return torch.device(device)


class EngineCore:
    def __init__(self, config: EngineConfig, timer: StartupTimer | None = None) -> None:
        """timer: the start-up phases so far (core_proc.py's, with the process's imports); they and this
        constructor's go into capacity.startup_seconds."""
        t0 = time.monotonic()
        if timer is None:
            timer = StartupTimer(t0)
        else:
            timer.mark("imports")
        self.config = config
        _validate_config(config)
        self.model_path = resolve_model(config.model)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        mc = self.model_config
        self.device = resolve_device(config.device)
        validate_parallel(config, mc, self.device.type)  # before any weight is read
        self.group: LeaderGroup | None = None
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if tp * pp > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda:0")
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device.type)
        dtype_name = str(self.dtype).removeprefix("torch.")

        max_model_len = config.max_model_len or mc.max_model_len
        if max_model_len > mc.max_model_len:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than this model supports ({mc.max_model_len} "
                f"tokens); use --max-model-len {mc.max_model_len} or less"
            )
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(mc.eos_token_ids)

        kv_per_token = kv_memory.kv_bytes_per_token(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, dtype_name, tp, pp
        )
        # When the pool size is known from the config alone, refuse a misfit before reading any weight
        # (a crash-looping pod should not spend minutes loading a model that cannot run).
        sized_early = config.num_kv_blocks is not None or config.kv_cache_memory is not None
        sized_early = sized_early or self.device.type != "cuda"
        if sized_early:
            num_blocks = self._num_kv_blocks(kv_per_token)
            self._check_pool(num_blocks, kv_per_token, dtype_name)
        timer.mark("config")
        par = SINGLE
        if tp * pp > 1:  # the other ranks start now and load their shards alongside this one
            step_bytes = 8 * max_packed_len(
                config.max_num_seqs, config.max_num_batched_tokens, max_model_len, config.block_size
            )
            self.group = start_leader(
                dataclasses.replace(config, model=str(self.model_path)), self.device, step_bytes
            )
            par = self.group.par
            timer.mark("ranks")
        if self.device.type == "cpu":
            # Build (or load) the C++ kernels now, while /health still says loading: built lazily, the
            # first request waited for the compile (15-45 s) and a client's timeout cut it.
            cpu_kernels.load()
            timer.mark("kernels")
        torch.manual_seed(config.seed)
        # A bf16 CPU model with fp32 weight files (a GGUF conversion) is loaded in fp32: ModelRunner finds
        # the weights' integer codes, which single rows run from, then casts it (layers.bf16_codes_wanted).
        load_dtype = self.dtype
        if tp * pp == 1 and bf16_codes_wanted(self.device, self.dtype) and checkpoint_is_float32(self.model_path):
            load_dtype = torch.float32
        model = load_model(self.model_path, mc, load_dtype, self.device, par)
        timer.mark("weights")
        if not sized_early:
            num_blocks = self._num_kv_blocks(kv_per_token)
        num_blocks = agree_num_kv_blocks(num_blocks, par)
        self._check_pool(num_blocks, kv_per_token, dtype_name)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, max_model_len)
        blocks = None
        packs_blocks = self.device.type == "cpu" and load_dtype == torch.float32 and cpu_linear_mode() == "1"
        if packs_blocks and tp * pp == 1 and cpu_kernels.available():
            # The integer blocks of these weights, found at an earlier start (block_cache.py).
            blocks = weight_blocks.block_cache = block_cache.open_cache(
                model, self.model_path, cpu_kernels.build_name()
            )
        try:
            self.runner = make_runner(model, mc, config, num_blocks, max_model_len, self.dtype, self.device, par)
        finally:
            weight_blocks.block_cache = None
        timer.mark("runner")  # packing the weights for the CPU kernel, the KV pool
        if blocks is not None:
            block_cache.save_cache(blocks)
            timer.mark("block cache")
        self.structured_outputs = StructuredOutputManager(self.model_path, mc.vocab_size, self.eos_token_ids)
        self.counters = EngineCounters()
        timer.mark("other")
        self.capacity = EngineCapacity(
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            kv_tokens=num_blocks * config.block_size,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_concurrency=kv_memory.max_concurrency(num_blocks, config.block_size, max_model_len),
            model_load_seconds=time.monotonic() - t0,
            dtype=dtype_name,
            device=str(self.device),
            kv_bytes_per_token=kv_per_token,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            startup_seconds=dict(timer.phases),
        )
        logger.info(self.capacity.describe())
        logger.info("engine core start-up: %s", self.capacity.describe_startup())

    def shutdown(self) -> None:
        """Stop the other parallel ranks (nothing to do on one rank); also runs at interpreter exit."""
        if self.group is not None:
            self.group.shutdown()

    def _check_pool(self, num_blocks: int, kv_per_token: int, dtype_name: str) -> None:
        config, max_model_len = self.config, self.max_model_len
        need = kv_memory.blocks_for_tokens(max_model_len, config.block_size)
        if num_blocks < need:
            have_tokens = num_blocks * config.block_size
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {config.block_size} tokens = {have_tokens} tokens, "
                f"but one sequence of max_model_len={max_model_len} needs {need} blocks "
                f"({kv_per_token * config.block_size * need / 2**20:.1f} MiB in {dtype_name}); raise "
                f"--num-kv-blocks to at least {need} (or --kv-cache-memory) or lower --max-model-len to at most "
                f"{have_tokens}"
            )

    def _num_kv_blocks(self, kv_per_token: int) -> int:
        return num_kv_blocks_for(self.config, self.device, kv_per_token)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        p = req.sampling_params
        ids = req.prompt_token_ids
        if not ids:
            raise ValueError("the prompt must contain at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, longer than max_model_len={self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        bad = [t for t in [*p.logit_bias, *p.stop_token_ids] if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids in logit_bias/stop_token_ids must be in [0, {vocab}); got {bad[:5]}")
        if req.request_id in self.scheduler.requests or self.structured_outputs.has_request(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        seqs = []
        for i in range(p.n):
            gen = None
            if p.seed is not None:
                # Choice i draws from seed + i, so n > 1 with a seed gives n different, reproducible samples.
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed + i)
            seqs.append(
                Request(
                    request_id=req.request_id,
                    index=i,
                    token_ids=list(ids),
                    num_prompt_tokens=len(ids),
                    params=p,
                    arrival_time=req.arrival_time,
                    priority=req.priority,
                    cache_salt=req.cache_salt,
                    eos_token_ids=self.eos_token_ids,
                    generator=gen,
                )
            )
        seqs[0].fork_children = seqs[1:]
        self.counters.num_prompt_tokens += len(ids)
        if p.structured_outputs is not None:
            self.structured_outputs.submit(seqs)  # enters the scheduler once its grammar is compiled
        else:
            self._schedule_seqs(seqs)

    def _schedule_seqs(self, seqs: list[Request]) -> None:
        self.scheduler.add_request(seqs[0])
        self.scheduler.requests[seqs[0].request_id].extend(seqs[1:])

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.structured_outputs.abort(rid)
            self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.structured_outputs.pending)

    def num_kv_blocks_in_use(self) -> int:
        return self.kv.num_used_blocks

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        outputs = self._admit_compiled()
        sched = self.scheduler.schedule()
        if sched.scheduled:
            block_ids = [self.kv.block_ids(r) for r, _ in sched.scheduled]
            try:
                tokens, logprobs, sampled = self.runner.execute(sched.scheduled, block_ids)
            except Exception as e:
                if self.group is not None:  # name the rank that took the step down
                    self.group.step_failed(e, self.config.collective_timeout_s)
                raise
            held = slots = 0
            for req, n in sched.scheduled:
                req.num_computed_tokens += n
                self.kv.cache_full_blocks(req)
                held += req.num_computed_tokens
                slots += len(self.kv.block_ids(req))
                if req.fork_children and req.num_computed_tokens >= req.num_prompt_tokens:
                    self._fork_children(req)
            for req, token, lp in zip(sampled, tokens, logprobs, strict=True):
                outputs.append(self._append_token(req, token, lp))
            c = self.counters
            c.num_steps += 1
            c.num_generated_tokens += len(sampled)
            # Occupancy and KV utilisation over the sequences that ran this step, measured before the
            # finished ones free their blocks.
            c.sum_running_seqs += len(sched.scheduled)
            slots *= self.kv.block_size
            c.sum_kv_utilization += held / slots if slots else 0.0
        c = self.counters
        c.num_preemptions += sched.num_preemptions
        c.prefix_cache_queries += sched.prefix_cache_queries
        c.prefix_cache_hit_tokens += sched.prefix_cache_hits
        stats = SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            num_scheduled_tokens=sched.num_scheduled_tokens,
            num_compiling=len(self.structured_outputs.pending),
            queue_times=sched.queue_times,
        )
        return outputs, stats

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move requests whose grammar finished compiling into the scheduler; a failed compile ends the
        request (the API process validates first, so this is the offline or racing case)."""
        idle = not self.scheduler.has_unfinished()
        outputs = []
        for seqs, err in self.structured_outputs.pop_ready(wait=idle):
            if err is None:
                self._schedule_seqs(seqs)
                continue
            logger.warning("request %s: its grammar failed to compile: %s", seqs[0].request_id, err)
            for seq in seqs:
                outputs.append(
                    EngineCoreOutput(seq.request_id, seq.index, [], finish_reason="abort", stop_reason=str(err))
                )
        return outputs

    def _fork_children(self, parent: Request) -> None:
        # Share the prompt's full blocks, leaving at least one token for each child to compute: it
        # needs its own logits to sample its first token.
        shared = (parent.num_prompt_tokens - 1) // self.kv.block_size
        for child in parent.fork_children:
            self.kv.fork(parent, child, shared)
            child.num_computed_tokens = shared * self.kv.block_size
            self.scheduler.add_request_seq(child)
        parent.fork_children = []

    def _append_token(self, req: Request, token: int, lp) -> EngineCoreOutput:
        req.token_ids.append(token)
        p = req.params
        reason: str | None = None
        stop_reason: int | str | None = None
        n_out = req.num_output_tokens
        if req.grammar is not None and accept_token(req, token):
            reason = "stop"  # the grammar accepted a stop token or can take nothing more
        elif n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                reason = "stop"
            elif token in p.stop_token_ids:
                reason, stop_reason = "stop", token
        if reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.running.remove(req)
            self.scheduler.finish(req, reason, stop_reason)
        return EngineCoreOutput(
            request_id=req.request_id,
            index=req.index,
            new_token_ids=[token],
            new_logprobs=[lp] if lp is not None else None,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_cached_tokens=req.num_cached_tokens,
        )

    def stats(self) -> dict[str, float | int]:
        c = self.counters
        steps = max(c.num_steps, 1)
        return {
            "num_steps": c.num_steps,
            "num_prompt_tokens": c.num_prompt_tokens,
            "num_generated_tokens": c.num_generated_tokens,
            "num_preemptions": c.num_preemptions,
            "prefix_cache_queries": c.prefix_cache_queries,
            "prefix_cache_hit_tokens": c.prefix_cache_hit_tokens,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_in_use": self.kv.num_used_blocks,
            "mean_running_seqs": c.sum_running_seqs / steps,
            "mean_kv_utilization": c.sum_kv_utilization / steps,
            "max_num_seqs": self.config.max_num_seqs,
        }

    def reset_stats(self) -> None:
        self.counters = EngineCounters()


def num_kv_blocks_for(cfg: EngineConfig, device: torch.device, kv_per_token: int) -> int:
    """Blocks of one rank's pool (kv_per_token: that rank's bytes per token)."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    budget = cfg.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * CUDA_KV_CACHE_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
    return kv_memory.num_kv_blocks(budget, cfg.block_size, kv_per_token)


def _validate_config(c: EngineConfig) -> None:
    if c.block_size not in (8, 16, 32, 64, 128):
        raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {c.block_size}")
    if c.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {c.max_num_seqs}")
    if c.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {c.max_num_batched_tokens}")
    if c.max_model_len is not None and c.max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {c.max_model_len}")
    if c.num_kv_blocks is not None and c.num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be at least 1, got {c.num_kv_blocks}")
    if c.kv_cache_memory is not None and c.kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {c.kv_cache_memory}")
    if c.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {c.dtype!r}")
