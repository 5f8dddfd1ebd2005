"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, sampling_params)."""

import sys
from collections.abc import Sequence
from typing import Any

from tokenmill.engine.config import DEFAULTS, EngineConfig
from tokenmill.engine.frontend.generation_config import default_sampling_params
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.model.source import parse_model_source
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tqdm import tqdm


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        block_size: int = 16,
        max_num_seqs: int = DEFAULTS.max_num_seqs,
        max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        kv_cache_dtype: str = "auto",
        int8_activations: bool = False,
        enable_prefix_caching: bool = True,
        device: str = "auto",
        seed: int = 0,
        generation_config: str | None = None,
        override_generation_config: dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_lora: bool = False,
        max_loras: int = DEFAULTS.max_loras,
        max_lora_rank: int = DEFAULTS.max_lora_rank,
        max_cpu_loras: int | None = None,
        kv_events_config: dict[str, Any] | None = None,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                device=device,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory=kv_cache_memory,
                kv_cache_dtype=kv_cache_dtype,
                int8_activations=int8_activations,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                enable_lora=enable_lora,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras,
                kv_events_config=kv_events_config,
            )
        )

        # Sampling for calls that pass no SamplingParams, as `tokenmill serve --generation-config`.
        self.default_sampling, self.default_sampling_source = default_sampling_params(
            generation_config,
            self.engine.core.model_path,
            parse_model_source(model).scheme == "bundled",
            override_generation_config,
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's name: the model's generation-config defaults over SamplingParams' own."""
        return SamplingParams(**self.default_sampling)

    @property
    def capacity(self):
        return self.engine.core.capacity

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given. lora_request: one adapter for every prompt, or
        one per prompt (None: the base model), as in vLLM."""
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("give prompts or prompt_token_ids, not both")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None:
            texts: list[str | None] = list(prompts)
            ids = [self.engine.tokenize(p) for p in prompts]
        else:
            ids = [list(p) for p in prompt_token_ids]
            texts = [None] * len(ids)
        return self._run(texts, ids, sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [self.engine.apply_chat_template(c) for c in conversations]
        return self._run([None] * len(ids), ids, sampling_params, use_tqdm, None)

    def stats(self) -> dict[str, float | int]:
        return self.engine.core.stats()

    def reset_stats(self) -> None:
        self.engine.core.reset_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's LLM.reset_prefix_cache); False while requests hold blocks."""
        return self.engine.core.reset_prefix_cache()

    def _run(
        self,
        texts: list[str | None],
        ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(ids)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} sampling params for {len(ids)} prompts")
        prios = list(priority) if priority is not None else [0] * len(ids)
        if len(prios) != len(ids):
            raise ValueError(f"got {len(prios)} priorities for {len(ids)} prompts")
        loras = [lora_request] * len(ids) if lora_request is None or isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != len(ids):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(ids)} prompts")
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for i, (text, tok, p, prio, lora) in enumerate(zip(texts, ids, params, prios, loras, strict=True)):
                order[engine.add_request(text, tok, p, priority=prio, lora_request=lora)] = i
            results: list[RequestOutput | None] = [None] * len(ids)
            bar = tqdm(
                total=len(ids), desc="generate", unit="req", disable=not use_tqdm or not sys.stderr.isatty()
            )
            with bar:
                while engine.has_unfinished_requests():
                    for out in engine.step(emit_unfinished=False):
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            # Nothing leaks: every request this call added is aborted and its blocks freed.
            for rid in order:
                engine.abort_request(rid)
            raise
        return results  # type: ignore[return-value]
