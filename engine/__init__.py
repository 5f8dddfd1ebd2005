"""tokenmill's inference engine.

Exports are lazy so that dependency-free modules (``kv_memory``, ``metric_names``) can be imported by
the operator image, which has no torch.
"""

from typing import Any

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from tokenmill.engine.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "LoRARequest":
        from tokenmill.engine.lora_request import LoRARequest

        return LoRARequest
    if name == "RequestOutput":
        from tokenmill.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(name)
