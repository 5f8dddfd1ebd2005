"""The engine core's side of structured outputs: compile off the loop, one matcher per sequence.

A request with structured_outputs waits here (holding no KV block) until its grammar is compiled on
the grammar thread, then enters the scheduler with a fresh xgrammar GrammarMatcher on each of its n
sequences. The matcher lives on the Request and advances only when the engine appends a newly sampled
token, so recompute after preemption and prefix-cache hits (which recompute or skip prompt and
already-generated tokens, never sample them again) leave it where it was.
"""

import concurrent.futures
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.engine.model.tokenizer import load_tokenizer
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar (and the transformers it imports: 2 s of an engine start) on first use only
    from tokenmill.engine.structured_output.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

# How long an otherwise idle step waits for a compile to finish before returning to the loop (which
# then checks for new requests and aborts).
IDLE_WAIT_SECONDS = 0.05


@dataclass(slots=True)
class PendingRequest:
    seqs: list[Request]  # all n sequences; seqs[0] carries the others as fork_children
    future: Future


class StructuredOutputManager:
    def __init__(self, model_path: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # One thread: compiles run in arrival order; xgrammar releases the GIL while compiling.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: GrammarCompiler | None = None
        self.pending: list[PendingRequest] = []

    def compiler(self) -> "GrammarCompiler":
        """Built on first use (loads the tokenizer and builds xgrammar's tokenizer info, ~1 s)."""
        if self._compiler is None:
            from tokenmill.engine.structured_output.grammar import compiler_for

            tokenizer = load_tokenizer(self.model_path)
            self._compiler = compiler_for(tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def compile(self, so: StructuredOutputsParams) -> Any:
        """Blocking compile (the offline LLM validates with it before admission; the result is cached)."""
        return self.compiler().compile(so)

    def submit(self, seqs: list[Request]) -> None:
        so = seqs[0].params.structured_outputs
        self.pending.append(PendingRequest(seqs, self._executor.submit(self.compile, so)))

    def pop_ready(self, wait: bool) -> list[tuple[list[Request], Exception | None]]:
        """Requests whose compile finished, each with its matchers attached, or the compile error.
        wait: block briefly for the first one (only when the engine has nothing else to run)."""
        if not self.pending:
            return []
        if wait and not any(p.future.done() for p in self.pending):
            concurrent.futures.wait(
                [p.future for p in self.pending], timeout=IDLE_WAIT_SECONDS, return_when="FIRST_COMPLETED"
            )
        ready, still = [], []
        for p in self.pending:
            if not p.future.done():
                still.append(p)
                continue
            err = p.future.exception()
            if err is None:
                import xgrammar as xgr  # imported by the compile already

                compiled = p.future.result()
                for seq in p.seqs:  # n > 1: each choice its own matcher
                    seq.grammar = xgr.GrammarMatcher(compiled)
            ready.append((p.seqs, err))
        self.pending = still
        return ready

    def abort(self, request_id: str) -> bool:
        before = len(self.pending)
        self.pending = [p for p in self.pending if p.seqs[0].request_id != request_id]
        return len(self.pending) != before

    def has_request(self, request_id: str) -> bool:
        return any(p.seqs[0].request_id == request_id for p in self.pending)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def accept_token(req: Request, token: int) -> bool:
    """Advance the sequence's matcher by its newly sampled token. Returns whether the grammar has
    terminated (it accepted a stop token, or it can accept nothing more)."""
    m = req.grammar
    if not m.accept_token(token):
        # The mask allowed only grammar tokens, so this means a bug or a sampler bypass: end the sequence
        # rather than emit output that breaks the promised format.
        logger.error("request %s: sampled token %d is not allowed by its grammar", req.key, token)
        return True
    return m.is_terminated()
