"""`tokenmill bench output-path`: CPU cost per generated token of the API process's output path.

The API process turns each engine step's token ids into text (OutputProcessor: detokenization, stop
strings, logprobs) and, for a stream, into one SSE chunk per request per step. This measures that work
alone, without a model: B requests x L steps of one token each (ids of a real text, the real bundled
tokenizer and the server's own pydantic chunk models), for each RequestOutputKind, in one process,
interleaved rounds, best round kept. It reports CPU microseconds per token (process CPU time, which a
busy shared machine inflates less than wall time) and each kind's ratio to CUMULATIVE.
"""

import time
from typing import Any

from tokenmill.engine.core import EngineCoreOutput
from tokenmill.engine.frontend.output_processor import OutputProcessor, merge_delta
from tokenmill.engine.outputs import RequestOutput, RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.protocol import CompletionResponseChoice, CompletionStreamResponse
from tokenmill.engine.server.streaming import sse

TEXT = (
    "Once upon a time, the city of Nova Haven was a thriving metropolis, with towering skyscrapers and "
    "bustling streets. But as the years went by, the city began to lose its charm. Café owners moved "
    "away, 日本語 signs faded, and the people 🎉 who stayed wondered what had happened to their home. "
)

KINDS = {
    "cumulative": RequestOutputKind.CUMULATIVE,
    "delta": RequestOutputKind.DELTA,
    "final_only": RequestOutputKind.FINAL_ONLY,
}


def _token_ids(tokenizer: Any, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def _chunk(rid: str, text: str, finish: str | None) -> str:
    return sse(CompletionStreamResponse(
        id=rid, created=0, model="m", choices=[CompletionResponseChoice(index=0, text=text, finish_reason=finish)]
    ))  # fmt: skip


def run_once(
    tokenizer: Any, kind: RequestOutputKind, batch: int, tokens: int, stop: list[str], frame: bool
) -> tuple[float, int]:
    """CPU seconds for one run of `batch` requests x `tokens` steps, and the bytes of SSE produced.
    A stream consumer (frame=True) sees every output, as the server's completion stream does: for
    CUMULATIVE it slices the new text off the cumulative one, for DELTA it sends the delta."""
    ids = _token_ids(tokenizer, tokens)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=tokens, stop=stop)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        proc.add_request(rid, None, [1], params, 0.0, kind)
    sent = dict.fromkeys(rids, 0)
    pending: dict[str, RequestOutput] = {}
    nbytes = 0
    start = time.process_time()
    for step, tok in enumerate(ids):
        finish = "length" if step == tokens - 1 else None
        outs = [EngineCoreOutput(rid, 0, [tok], None, finish) for rid in rids]
        results, _ = proc.process_outputs(outs)
        for ro in results:
            if kind == RequestOutputKind.DELTA and ro.request_id in pending:
                ro = merge_delta(pending.pop(ro.request_id), ro)
            c = ro.outputs[0]
            if kind == RequestOutputKind.CUMULATIVE:
                delta = c.text[sent[ro.request_id] :]
                sent[ro.request_id] = len(c.text)
            else:
                delta = c.text
            if frame and (delta or c.finish_reason):
                nbytes += len(_chunk(ro.request_id, delta, c.finish_reason))
    return time.process_time() - start, nbytes


def run_output_path_bench(
    tokenizer: Any, batch: int, tokens: int, rounds: int, stop: list[str], frame: bool
) -> dict[str, Any]:
    best = dict.fromkeys(KINDS, float("inf"))
    for _ in range(rounds):
        for name, kind in KINDS.items():  # interleaved: every round runs every kind once
            best[name] = min(best[name], run_once(tokenizer, kind, batch, tokens, stop, frame)[0])
    n = batch * tokens
    rows = {
        name: {"cpu_us_per_token": round(1e6 * s / n, 2), "vs_cumulative": round(best["cumulative"] / s, 2)}
        for name, s in best.items()
    }
    return {"batch": batch, "tokens": tokens, "rounds": rounds, "stop": stop, "sse_framing": frame, "kinds": rows}
