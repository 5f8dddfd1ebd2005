"""RequestOutputKind: DELTA outputs concatenate to exactly the CUMULATIVE ones, FINAL_ONLY gives one
output equal to the cumulative final, for text with multi-byte characters, stop strings that span
tokens, logprobs and n > 1. Real bundled tokenizer; the engine core's outputs are written by hand."""

import pytest
from tokenmill.engine.core import EngineCoreOutput
from tokenmill.engine.frontend.output_processor import OutputProcessor, merge_delta
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.model.tokenizer import load_tokenizer
from tokenmill.engine.outputs import RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams

TEXT = "Café déjà vu: 日本語のテキスト 🎉🚀 and Ünïcödé ✓ done, and then some more words"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def run(tokenizer, kind, params, ids, chunk=1):
    """Feed `ids` to both choices of one request, `chunk` tokens per step (choice 1 lags by one token);
    returns every RequestOutput emitted."""
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 2, 3], params, 0.0, kind)
    emitted = []
    streams = [list(ids), [ids[0], *ids]]
    pos = [0] * params.n
    step = 0
    while proc.has_request("r"):
        outs = []
        for i in range(params.n):
            new = streams[i][pos[i] : pos[i] + chunk]
            pos[i] += len(new)
            last = pos[i] >= len(streams[i])
            lps = [(-0.5 * (step + k), [(t, -0.5 * (step + k))]) for k, t in enumerate(new)]
            outs.append(EngineCoreOutput("r", i, new, lps, "length" if last else None))
        results, _ = proc.process_outputs(outs)
        emitted.extend(results)
        step += 1
    return emitted


@pytest.mark.parametrize("stop", [[], ["日本語の"], ["🚀 and Ü"]])
@pytest.mark.parametrize("chunk", [1, 3])
def test_delta_and_final_only_equal_cumulative(tokenizer, stop, chunk) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(n=2, stop=stop, logprobs=1)
    cumulative = run(tokenizer, RequestOutputKind.CUMULATIVE, params, ids, chunk)
    deltas = run(tokenizer, RequestOutputKind.DELTA, params, ids, chunk)
    final_only = run(tokenizer, RequestOutputKind.FINAL_ONLY, params, ids, chunk)
    want = cumulative[-1]
    assert want.finished and len(cumulative) > 3
    assert len(final_only) == 1 and final_only[0].finished
    assert len(deltas) == len(cumulative)
    for i in range(2):
        w = want.outputs[i]
        if stop:
            assert stop[0] not in w.text and w.finish_reason == "stop"
        # the deltas, concatenated, are the cumulative text/tokens/logprobs, step by step
        for k in range(len(deltas)):
            c = cumulative[k].outputs[i]
            assert "".join(d.outputs[i].text for d in deltas[: k + 1]) == c.text
            assert [t for d in deltas[: k + 1] for t in d.outputs[i].token_ids] == c.token_ids
            assert [lp for d in deltas[: k + 1] for lp in d.outputs[i].logprobs] == c.logprobs
        f = final_only[0].outputs[i]
        assert (f.text, f.token_ids, f.logprobs, f.finish_reason) == (
            w.text, w.token_ids, w.logprobs, w.finish_reason
        )
        assert deltas[-1].outputs[i].finish_reason == w.finish_reason
    total = sum(len(c.token_ids) for c in want.outputs)
    assert want.metrics["num_generation_tokens"] == total
    assert final_only[0].metrics["num_generation_tokens"] == total == deltas[-1].metrics["num_generation_tokens"]


def test_merged_deltas_equal_the_cumulative_output(tokenizer) -> None:
    """A consumer that fell behind gets its pending deltas merged into one."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(n=2, logprobs=0)
    deltas = run(tokenizer, RequestOutputKind.DELTA, params, ids)
    cumulative = run(tokenizer, RequestOutputKind.CUMULATIVE, params, ids)
    merged = deltas[0]
    for d in deltas[1:7]:
        merged = merge_delta(merged, d)
    for i in range(2):
        assert merged.outputs[i].text == cumulative[6].outputs[i].text
        assert merged.outputs[i].token_ids == cumulative[6].outputs[i].token_ids
        assert merged.outputs[i].logprobs == cumulative[6].outputs[i].logprobs
