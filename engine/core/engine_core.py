"""EngineCore: one step at a time, schedule -> execute -> update, through a Scheduler and an Executor.

Runs in its own process behind the server (proc.py) or in-process for tests and the offline LLM. It sees
token ids only (tokenization, detokenization and stop strings live upstream) and holds no device code: the
device, the dtype, the kernels and the weights are the Worker's, reached through the Executor.
"""

import logging
import time

from tokenmill.engine import kv_memory
from tokenmill.engine.config import EngineConfig, parse_kv_events_config
from tokenmill.engine.core import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tokenmill.engine.core.capacity import EngineCapacity, StartupTimer
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.kv_events import make_publisher
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.executor.executor import Executor
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.request import Request
from tokenmill.engine.structured_output.manager import StructuredOutputManager
from tokenmill.engine.worker.engine_plan import check_kv_pool, plan_engine

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, timer: StartupTimer | None = None) -> None:
        """timer: the start-up phases so far (proc.py's, with the process's imports); they and this
        constructor's go into capacity.startup_seconds."""
        t0 = time.monotonic()
        if timer is None:
            timer = StartupTimer(t0)
        else:
            timer.mark("imports")
        # Everything that can be refused is refused here, before any weight is read.
        self.plan = plan = plan_engine(config)
        self.config = plan.config
        self.model_path, self.model_config, self.max_model_len = plan.model_path, plan.model_config, plan.max_model_len
        self.eos_token_ids = tuple(plan.model_config.eos_token_ids)
        timer.mark("config")
        self.executor = Executor(plan, timer.mark)
        num_blocks = self.executor.determine_num_kv_blocks()
        check_kv_pool(plan, num_blocks)
        self.executor.initialize_cache(num_blocks)
        timer.mark("runner")  # the KV pool (and on CUDA the captured graphs)
        kv_events = parse_kv_events_config(config.kv_events_config)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, enable_kv_cache_events=kv_events is not None
        )
        self.kv_events = make_publisher(kv_events, config.block_size)
        self.scheduler = Scheduler(config, self.kv, plan.max_model_len)
        self.structured_outputs = StructuredOutputManager(
            plan.model_path, plan.model_config.vocab_size, self.eos_token_ids
        )
        timer.mark("other")
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.capacity = EngineCapacity(
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            kv_tokens=num_blocks * config.block_size,
            max_model_len=plan.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_concurrency=kv_memory.max_concurrency(num_blocks, config.block_size, plan.max_model_len),
            model_load_seconds=time.monotonic() - t0,
            dtype=plan.dtype,
            device=str(self.executor.device),
            kv_bytes_per_token=plan.kv_bytes_per_token,
            kv_cache_dtype=config.kv_cache_dtype,
            kv_cache_dtype_resolved=plan.kv_cache_dtype,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            max_loras=config.max_loras if config.enable_lora else 0,
            max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
            lora_slot_bytes=plan.lora_slot_bytes,
            startup_seconds=dict(timer.phases),
        )
        logger.info(self.capacity.describe())
        logger.info("engine core start-up: %s", self.capacity.describe_startup())

    def shutdown(self) -> None:
        """Stop the other parallel ranks (nothing to do on one rank) and the KV-event publisher; also runs
        at interpreter exit."""
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.executor.shutdown()

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
        if self.scheduler.has_request(req.request_id) or self.structured_outputs.has_request(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        # Choice i of a seeded request draws from seed + i (the sampler makes its generator), so n > 1
        # with a seed gives n different, reproducible samples.
        seqs = [
            Request(
                request_id=req.request_id,
                index=i,
                token_ids=list(ids),
                num_prompt_tokens=len(ids),
                params=p,
                arrival_time=req.arrival_time,
                priority=req.priority,
                cache_salt=req.cache_salt,
                lora_request=req.lora_request,
                eos_token_ids=self.eos_token_ids,
            )
            for i in range(p.n)
        ]
        seqs[0].fork_children = seqs[1:]
        if p.structured_outputs is not None:
            self.structured_outputs.submit(seqs)  # enters the scheduler once its grammar is compiled
        else:
            self.scheduler.add_request(seqs[0])

    def add_lora(self, lora: LoRARequest) -> None:
        """Read an adapter into rank 0's host cache (a hit when it is there): its files and tensors are
        checked against the model now, so a broken adapter fails its request with the reason (a
        ValueError: 400), never a step. The other ranks read their shards when a step first names it."""
        if not self.config.enable_lora:
            raise ValueError(
                f"the request names LoRA adapter {lora.lora_name!r}, but this engine serves no adapters; "
                "start it with --enable-lora"
            )
        self.executor.add_lora(lora)

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
            tokens, logprobs, sampled = self.executor.execute_model(sched.scheduled, block_ids)
            outputs += self.scheduler.update_from_output(sched, tokens, logprobs, sampled)
        self._publish_kv_events()
        return outputs, self.scheduler.make_stats(sched, len(self.structured_outputs.pending))

    def _publish_kv_events(self) -> None:
        """This step's KV-cache events, as one batch (the publisher's thread builds and sends it)."""
        if self.kv_events is not None:
            records = self.kv.take_events()
            if records:
                self.kv_events.publish(records)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache; an AllBlocksCleared event). Only while no
        request holds a block: returns False, changing nothing, otherwise."""
        ok = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        if ok:
            logger.info("prefix cache reset")
        return ok

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move requests whose grammar finished compiling into the scheduler; a failed compile ends the
        request (the API process validates first, so this is the offline or racing case)."""
        idle = not self.scheduler.has_unfinished()
        outputs = []
        for seqs, err in self.structured_outputs.pop_ready(wait=idle):
            if err is None:
                self.scheduler.add_request(seqs[0])
                continue
            logger.warning("request %s: its grammar failed to compile: %s", seqs[0].request_id, err)
            for seq in seqs:
                outputs.append(
                    EngineCoreOutput(seq.request_id, seq.index, [], finish_reason="abort", stop_reason=str(err))
                )
        return outputs

    def stats(self) -> dict[str, float | int]:
        c = self.scheduler.counters
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
        self.scheduler.reset_counters()
