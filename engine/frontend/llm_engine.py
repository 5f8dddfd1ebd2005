"""Synchronous engine: tokenizer + in-process EngineCore + OutputProcessor (the offline API's loop)."""

import itertools
import time
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.frontend.output_processor import OutputProcessor
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.model.tokenizer import load_tokenizer
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = load_tokenizer(self.core.model_path)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already carries any BOS; adding special tokens again would double it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        if params.structured_outputs is not None:
            # Offline: compile here so a bad spec raises ValueError now (cached for the engine's matcher).
            self.core.structured_outputs.compile(params.structured_outputs)
        rid = request_id if request_id is not None else str(next(self._ids))
        now = time.monotonic()
        self.core.add_request(
            EngineCoreRequest(rid, prompt_token_ids, params, now, priority, cache_salt, lora_request)
        )
        self.processor.add_request(rid, prompt, prompt_token_ids, params, now)
        return rid

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests([request_id])
        self.processor.abort_request(request_id)

    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        outputs, _stats = self.core.step()
        results, to_abort = self.processor.process_outputs(outputs, emit_unfinished)
        if to_abort:
            self.core.abort_requests(to_abort)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()
