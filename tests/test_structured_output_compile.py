"""engine/structured_output/grammar.py: the API process's validation (a ValueError naming the construct), the
LRU keyed by the canonical spec, and compiling in a thread while the caller's thread keeps running."""

import threading
import time

import pytest
import xgrammar as xgr
from tokenmill.engine.model.resolve import resolve_model
from tokenmill.engine.model.tokenizer import load_tokenizer
from tokenmill.engine.sampling_params import StructuredOutputsParams as S
from tokenmill.engine.structured_output.grammar import (
    GrammarCompiler,
    canonical_key,
    compiler_for,
    validate_structured_outputs,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return compiler_for(tokenizer, None, [2])


@pytest.mark.parametrize(
    ("so", "needle"),
    [
        (S(json={"type": "object", "properties": {"a": {"type": "tuple"}}}), r'json: .*Unsupported type "tuple"'),
        (S(json='{"type": "object",'), r"json: the schema is not valid JSON"),
        (S(json="[1, 2]"), r"json: a JSON schema must be an object or a boolean, got list"),
        (S(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}), r"json: .*missing"),
        (S(regex="(?<=a)b"), r"regex: .*Lookbehind is not supported"),
        (S(regex="[a-"), r"regex: .*Unclosed '\['"),
        (S(grammar="root ::= undefined_rule"), r'grammar: .*Rule "undefined_rule" is not defined'),
    ],
)
def test_invalid_specs_name_the_construct(tokenizer, so, needle):
    with pytest.raises(ValueError, match=r"^structured_outputs\." + needle):
        validate_structured_outputs(so, tokenizer, [2])


def test_valid_specs_accept_what_they_describe(compiler):
    cases = [
        (S(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}), '{"n": 42}'),
        (S(json_object=True), '{"any": [1, "x", null]}'),
        (S(regex="[0-9]{3}"), "123"),
        (S(choice=['say "hi"', "café"]), 'say "hi"'),
        (S(choice=['say "hi"', "café"]), "café"),
        (S(grammar='root ::= "a" | "b" "c"'), "bc"),
    ]
    for so, text in cases:
        m = xgr.GrammarMatcher(compiler.compile(so))
        assert m.accept_string(text) and m.is_completed(), (so, text)
    # strict (the default) refuses a property the schema does not name; non-strict allows it
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert not xgr.GrammarMatcher(compiler.compile(S(json=schema))).accept_string('{"extra": 1}')
    assert xgr.GrammarMatcher(compiler.compile(S(json=schema, strict=False))).accept_string('{"extra": 1}')


def test_lru_is_keyed_by_the_canonical_spec(tokenizer):
    comp = GrammarCompiler(compiler_for(tokenizer, None, [2]).tokenizer_info, max_cached=2)
    a_dict = S(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}})
    a_text = S(json='{"type":  "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}')
    swapped = S(json={"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}})
    assert canonical_key(a_dict) == canonical_key(a_text)
    assert canonical_key(a_dict) != canonical_key(swapped)  # property order is the output's order
    assert canonical_key(a_dict) != canonical_key(S(json=a_dict.json, strict=False))
    assert comp.compile(a_dict) is comp.compile(a_text)
    assert comp.num_compiles == 1
    comp.compile(swapped)
    comp.compile(S(regex="x+"))  # a third entry evicts the least recently used (a_dict)
    assert len(comp) == 2
    comp.compile(a_dict)
    assert comp.num_compiles == 4


def test_a_compile_in_a_thread_lets_the_caller_run(compiler):
    """xgrammar releases the GIL while compiling: the calling thread keeps making progress."""
    props = {f"f{i}": {"type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]{2,9}"}}}
             for i in range(150)}
    so = S(json={"type": "object", "properties": props, "required": list(props)})
    done = threading.Event()
    worker = threading.Thread(target=lambda: (compiler.compile(so), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert ticks > 5
