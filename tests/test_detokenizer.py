"""Incremental detokenization: no broken UTF-8 characters, stop strings that span tokens."""

import itertools

import pytest
from tokenmill.engine.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.model.tokenizer import load_tokenizer
from tokenmill.engine.sampling_params import SamplingParams

TEXT = "Café déjà vu: 日本語のテキスト 🎉🚀 and Ünïcödé ✓ done"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def stream(tokenizer, ids, params):
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, params)
    shown = []
    stop = None
    for t in ids:
        stop = detok.update([t])
        shown.append(detok.output_text(finished=stop is not None))
        if stop is not None:
            break
    return detok, shown, stop


def test_multibyte_characters_split_across_tokens_never_emit_replacement_chars(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The emoji and CJK characters really are split: some single tokens decode to broken UTF-8.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok, shown, _ = stream(tokenizer, ids, SamplingParams())
    assert all("\ufffd" not in s for s in shown)
    assert detok.output_text(finished=True) == tokenizer.decode(ids)
    # Text only ever grows: what was shown is never taken back.
    assert all(b.startswith(a) for a, b in itertools.pairwise(shown))


def test_stop_string_spanning_tokens_is_caught_and_never_streamed(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "vu: 日本"
    detok, shown, hit = stream(tokenizer, ids, SamplingParams(stop=[stop]))
    assert hit == stop
    assert detok.output_text(finished=True) == TEXT[: TEXT.index(stop)]
    assert all(stop not in s and "vu: 日" not in s for s in shown)


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, _, hit = stream(tokenizer, ids, SamplingParams(stop=["done", "déjà"], include_stop_str_in_output=True))
    assert hit == "déjà"
    assert detok.output_text(finished=True) == "Café déjà"
