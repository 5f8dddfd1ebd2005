"""What every handler reads: the served names, the engine once it has loaded, its limits, and the
status /health reports; model checks and admission (the 429 when the waiting queue is full)."""

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from tokenmill.engine.core.client import EngineDeadError
from tokenmill.engine.frontend.async_llm import AsyncLLM, LoRAPoolFullError, QueueFullError
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.server.engine_errors import engine_error
from tokenmill.engine.server.errors import OpenAIError

RETRY_AFTER_S = 1  # what a 429 asks the client to wait; the queue drains at the engine's step rate


@dataclass
class ServerState:
    """Everything the handlers read; `engine` is None until the model has loaded."""

    served_model_names: list[str]
    model_root: str = ""
    api_key: str | None = None
    require_auth_for_metrics: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get a 413 (body_limit.py)
    engine: AsyncLLM | None = None
    metrics: Any = None  # ServerMetrics
    tokenizer: Any = None
    vocab_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0
    status: str = "loading"  # loading | ready | draining | dead | failed
    status_detail: str = "the model is loading"
    # SamplingParams field -> value for fields a request leaves out (engine/frontend/generation_config.py).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str = "hermes"  # hermes | none (serve_cli picks it from the chat template)
    template_uses_tools: bool = False  # False: tools go into the system message as text (server/tools/request.py)
    lora: Any = None  # LoRAServing (server/lora.py) when --enable-lora
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model), or a 404 listing what is served."""
        if name is None or name in self.served_model_names:
            return None
        lora = self.lora.adapters.get(name) if self.lora is not None else None
        if lora is not None:
            return lora
        served = [*self.served_model_names, *(self.lora.adapters if self.lora is not None else ())]
        raise OpenAIError(
            404,
            f"The model `{name}` does not exist. This server serves: {', '.join(served)}.",
            param="model",
            code="model_not_found",
        )

    def response_model(self, lora: LoRARequest | None) -> str:
        """The `model` a response reports: the adapter's name, or the base model's."""
        return self.model_name if lora is None else lora.lora_name

    def ready_engine(self) -> AsyncLLM:
        """The engine, or a 503 (loading, draining) / 500 (dead) that says why not."""
        if self.status == "ready" and self.engine is not None:
            return self.engine
        if self.status == "dead":
            raise OpenAIError(500, self.status_detail)
        raise OpenAIError(503, self.status_detail, headers={"Retry-After": str(RETRY_AFTER_S)})

    def admit(self, request_ids: list[str], lora: LoRARequest | None = None) -> AsyncLLM:
        engine = self.ready_engine()
        try:
            engine.admit(request_ids, lora)
        except QueueFullError as e:
            raise OpenAIError(
                429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except LoRAPoolFullError as e:
            raise OpenAIError(
                429, str(e), param="model", code="lora_pool_full", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except EngineDeadError as e:
            raise engine_error(e) from None
        return engine
