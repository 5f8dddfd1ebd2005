"""Worker: one rank of the engine, built the same way by rank 0 (in the engine core, through the executor)
and by every other rank (rank_main.py).

It owns what runs on the rank's device: the device itself, the kernels, the weights of its shard, the KV
pool and the ModelRunner. The engine core never touches any of it: it schedules, the executor hands each
step to the workers, and only rank 0's worker samples (its ModelRunner holds the sampler).
"""

import logging
from collections.abc import Callable

import torch
from tokenmill.engine import kv_memory
from tokenmill.engine.config import max_cpu_loras
from tokenmill.engine.distributed.parallel_state import (
    SINGLE,
    ParallelState,
    kv_head_range,
    layer_range,
    min_on_all_ranks,
)
from tokenmill.engine.layers.cpu_gemm_policy import int8x_bf16_supported
from tokenmill.engine.lora.manager import LoRAModelManager
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.model.loader import load_model
from tokenmill.engine.model.weight_codes_cache import open_cache, save_cache
from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.request import Request
from tokenmill.engine.worker.cpu_weights import (
    WeightPlan,
    loading_hooks,
    plan_weights,
    prepare_weights,
    use_int8_activations,
)
from tokenmill.engine.worker.device import DTYPES, KV_CACHE_TORCH_DTYPES
from tokenmill.engine.worker.engine_plan import CUDA_KV_CACHE_FRACTION, EnginePlan
from tokenmill.engine.worker.model_runner import ModelRunner
from tokenmill.engine.worker.step_input import StepInput
from tokenmill.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)


def _no_mark(name: str) -> None:
    return None


class Worker:
    def __init__(self, plan: EnginePlan, device: torch.device, par: ParallelState = SINGLE) -> None:
        self.plan = plan
        self.device = device
        self.par = par
        self.dtype = DTYPES[plan.dtype]
        self.weight_plan: WeightPlan = plan_weights(device, self.dtype, plan.model_path, par.world_size)
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.lora: LoRAModelManager | None = None

    def load_model(self, mark: Callable[[str], None] = _no_mark) -> None:
        """Build the kernels, read this rank's weights and pack them for the kernels that will run them.
        mark(phase): the start-up timer's (the engine core reports the phases)."""
        if self.device.type == "cpu":
            # Now, while /health still says loading: built lazily, the first request waited for the
            # compile (15-45 s) and a client's timeout cut it.
            cpu_kernels.load()
            mark("kernels")
        plan, wp = self.plan, self.weight_plan
        torch.manual_seed(plan.config.seed)
        caches = []  # the codes cache, opened once the model's parameters exist

        def hooks(model: torch.nn.Module) -> dict | None:
            # Codes search and fp32 packing run as the weights stream in: no second copy (cpu_weights.py).
            if wp.cache_codes:
                caches.append(open_cache(model, plan.model_path, cpu_kernels.build_name()))
            return loading_hooks(model, self.device, self.dtype, wp, caches[0] if caches else None)

        model = load_model(plan.model_path, plan.model_config, wp.load_dtype, self.device, self.par, hooks)
        mark("weights")
        cache = caches[0] if caches else None
        prepare_weights(model, self.device, self.dtype, wp, cache, streamed=True)
        mark("packing")
        if cache is not None:
            save_cache(cache)
            mark("codes cache")
        self.model = model
        cfg = plan.config
        if cfg.int8_activations:
            on_cpu = self.device.type == "cpu"  # (int8x_bf16_supported loads the CPU kernels)
            takes = self.dtype == torch.float32 or (on_cpu and self.dtype == torch.bfloat16 and int8x_bf16_supported())
            n = use_int8_activations(model) if takes else 0
            if n:
                logger.info("int8 activations: %d integer-code weights round x to int8 per 32 values", n)
            else:  # a flag shared by deployments on several CPU kinds: not an error where it cannot apply
                logger.warning(
                    "--int8-activations has no effect: this model is served in %s without integer codes its "
                    "kernel takes (it applies to Q4_0/Q4_1/Q8_0/Q4_K GGUF and AWQ/GPTQ int4 weights served in float32 on an AVX2 CPU, "
                    "or in bfloat16 on an AVX-512 VNNI + VBMI CPU)", plan.dtype,
                )
        if cfg.enable_lora:  # the slots now: on CUDA the KV pool is sized from the memory left after them
            self.lora = LoRAModelManager(
                model, plan.model_config, self.par, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
                max_cpu_loras=max_cpu_loras(cfg), max_rows=max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                dtype=self.dtype, device=self.device,
            )  # fmt: skip

    def determine_num_kv_blocks(self) -> int:
        """Blocks of this rank's pool: the plan's, or on CUDA what fits in the memory free after the weights;
        every rank's pool then takes the smallest any rank fits (a collective: all ranks call it)."""
        num_blocks = self.plan.num_kv_blocks
        if num_blocks is None:
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * CUDA_KV_CACHE_FRACTION)
            num_blocks = kv_memory.num_kv_blocks(budget, self.plan.config.block_size, self.plan.kv_bytes_per_token)
        return min_on_all_ranks(num_blocks, self.par)

    def initialize_cache(self, num_blocks: int) -> None:
        """The KV pool for this rank's stage's layers and its KV heads, and the runner that reads it."""
        mc, cfg, par = self.plan.model_config, self.plan.config, self.par
        self.runner = ModelRunner(
            self.model,
            num_layers=len(layer_range(mc.num_hidden_layers, par.pp_rank, par.pp_size)),
            num_kv_heads=len(kv_head_range(mc.num_key_value_heads, par.tp_rank, par.tp_size)),
            head_dim=mc.head_dim,
            vocab_size=mc.vocab_size,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.plan.max_model_len,
            dtype=self.dtype,
            kv_cache_dtype=KV_CACHE_TORCH_DTYPES[self.plan.kv_cache_dtype],
            device=self.device,
            enforce_eager=cfg.enforce_eager,
            hidden_size=mc.hidden_size,
            par=par,
            lora=self.lora,
        )
        logger.info("rank %d (tp %d, pp %d) ready: %d KV blocks (%s) on %s", par.rank, par.tp_rank, par.pp_rank,
                    num_blocks, self.plan.kv_cache_dtype, self.device)  # fmt: skip

    def execute_model(
        self, scheduled: list[tuple[Request, int]], block_ids: list[list[int]]
    ) -> tuple[list[int], list[TokenLogprobs | None], list[Request]]:
        """Rank 0: run the step on every rank, sample. Returns the sampled tokens (and logprobs) of the
        sequences whose scheduled tokens reach their end."""
        return self.runner.execute(scheduled, block_ids)

    def add_lora(self, lora: LoRARequest) -> None:
        """Rank 0: read an adapter into the host cache now (its tensors checked against the model), so that
        a broken one fails its request, not a step."""
        self.lora.add_lora(lora)

    def forward(self, step: StepInput) -> None:
        """Other ranks: this rank's part of a step rank 0 broadcast."""
        self.runner.forward(step)
