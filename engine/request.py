"""One sequence the engine works on: a request's prompt and one of its n choices."""

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.sampling_params import SamplingParams

_seq_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    index: int  # choice index within the request (n > 1)
    token_ids: list[int]  # prompt followed by every generated token
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None  # mixed into the first block's hash (see kv_cache_manager.py)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model); hashed as the salt is
    eos_token_ids: tuple[int, ...] = ()
    # The one number that covers chunked prefill, prefix-cache hits and recompute preemption.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: Any = None  # a seeded choice's torch.Generator, made by the sampler on its first draw
    first_scheduled_time: float | None = None
    seq_no: int = field(default_factory=lambda: next(_seq_counter))
    # n > 1: choices other than 0 wait for choice 0's prompt, then share its full prompt blocks.
    fork_children: list["Request"] = field(default_factory=list)
    # structured outputs: this sequence's xgrammar GrammarMatcher (structured_output/manager.py)
    grammar: Any = None
    # Chained prefix-cache hashes of the full blocks of token_ids, computed once each: tokens are only
    # ever appended, so a full block's hash never changes (not even across preemption).
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.request_id}#{self.index}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def sort_key(self) -> tuple[int, float, int]:
        # Lower priority value first, then arrival: FCFS is the all-zero-priority case.
        return (self.priority, self.arrival_time, self.seq_no)

    def __lt__(self, other: "Request") -> bool:
        return self.sort_key < other.sort_key
