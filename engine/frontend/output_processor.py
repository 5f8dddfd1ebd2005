"""Turns the engine core's token ids into RequestOutputs: detokenization, stop strings, logprobs.

Each request says what its outputs hold (RequestOutputKind): everything so far (CUMULATIVE, the
offline API's and the old default), only what is new since its last output (DELTA, for streams), or
one output at the end (FINAL_ONLY, for non-streamed responses)."""

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.core import EngineCoreOutput
from tokenmill.engine.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class _Choice:
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA: how much of the text / token ids / logprobs earlier outputs carried
    sent_chars: int = 0
    sent_tokens: int = 0


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    choices: list[_Choice]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        # A transformers fast tokenizer; DecodeStream needs the underlying tokenizers.Tokenizer.
        self.backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        choices = [
            _Choice(
                detok=IncrementalDetokenizer(self.backend, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for _ in range(params.n)
        ]
        self.states[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), params, arrival_time, choices, output_kind
        )

    def abort_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def process_outputs(
        self, outputs: list[EngineCoreOutput], emit_unfinished: bool = True
    ) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs (of each request's kind) for every request touched (only finished ones when
        emit_unfinished is False, as the offline API needs, or the request is FINAL_ONLY), and the ids to
        abort in the core (every choice finished upstream, e.g. on a stop string, while the core may
        still hold sequences)."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            choice = state.choices[out.index]
            if choice.finish_reason is not None:
                continue  # finished upstream already (stop string); late tokens are dropped
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            choice.token_ids.extend(out.new_token_ids)
            if choice.logprobs is not None and out.new_logprobs:
                for token, (lp, top) in zip(out.new_token_ids, out.new_logprobs, strict=True):
                    entry = {token: lp}
                    for tid, tlp in top:
                        entry.setdefault(tid, tlp)
                    choice.logprobs.append(entry)
                    choice.cumulative_logprob += lp
            stop_str = choice.detok.update(out.new_token_ids)
            if stop_str is not None:
                choice.finish_reason, choice.stop_reason = "stop", stop_str
            elif out.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            touched[out.request_id] = state

        results = []
        for rid, state in touched.items():
            finished = all(c.finish_reason is not None for c in state.choices)
            if finished:
                del self.states[rid]
                if any(
                    c.finish_reason == "stop" and isinstance(c.stop_reason, str) for c in state.choices
                ):
                    to_abort.append(rid)
            if finished or (emit_unfinished and state.output_kind != RequestOutputKind.FINAL_ONLY):
                results.append(self._make_output(state, finished))
        return results, to_abort

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        if state.output_kind == RequestOutputKind.DELTA:
            outs = [self._delta(i, c) for i, c in enumerate(state.choices)]
        else:
            # A finished request's state is dropped, so its lists can be handed over without a copy.
            copy = list if not finished else _same
            outs = [
                CompletionOutput(
                    index=i,
                    text=c.detok.output_text(c.finish_reason is not None),
                    token_ids=copy(c.token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=copy(c.logprobs) if c.logprobs is not None else None,
                    cumulative_logprob=c.cumulative_logprob,
                )
                for i, c in enumerate(state.choices)
            ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            # Every kind's final output says how many tokens the request generated in all.
            metrics={"num_generation_tokens": sum(len(c.token_ids) for c in state.choices)} if finished else {},
        )

    @staticmethod
    def _delta(index: int, c: _Choice) -> CompletionOutput:
        """What is new in one choice since its last output: text (minus a held-back stop-string
        prefix), token ids and logprobs."""
        end = c.detok.visible_len(c.finish_reason is not None)
        text = c.detok.text[c.sent_chars : end] if end > c.sent_chars else ""
        c.sent_chars = max(c.sent_chars, end)
        new_ids = c.token_ids[c.sent_tokens :]
        logprobs = c.logprobs[c.sent_tokens :] if c.logprobs is not None else None
        c.sent_tokens = len(c.token_ids)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=new_ids,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=c.cumulative_logprob,
        )


def _same(x: list) -> list:
    return x


def merge_delta(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one (a consumer that fell behind)."""
    outs = []
    for a, b in zip(earlier.outputs, later.outputs, strict=True):
        outs.append(
            CompletionOutput(
                index=b.index,
                text=a.text + b.text,
                token_ids=a.token_ids + b.token_ids,
                finish_reason=b.finish_reason,
                stop_reason=b.stop_reason,
                logprobs=a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else None,
                cumulative_logprob=b.cumulative_logprob,
            )
        )
    later.outputs = outs
    return later
