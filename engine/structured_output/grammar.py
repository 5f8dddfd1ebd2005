"""Compile structured-output specs with xgrammar: one compiler per tokenizer, an LRU of compiled grammars.

Used by the API process (validate before admission: a ValueError here is a 400) and by the engine core's
grammar thread (structured_output/manager.py). Compiling releases the GIL inside xgrammar, so a compile
in a worker thread does not stall the engine loop.
"""

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr
from tokenmill.engine.sampling_params import StructuredOutputsParams

# Compiled grammars kept per compiler. A JSON schema's grammar is typically tens to hundreds of KB.
MAX_CACHED_GRAMMARS = 256

# xgrammar's C++ errors start with "[HH:MM:SS] /path/file.cc:LINE: " and sometimes "Check failed: ... is
# false: "; the user needs only the sentence after them.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def canonical_key(so: StructuredOutputsParams) -> str:
    """One string per distinct grammar. JSON schemas are re-serialized compactly but keep their key
    order (property order is the order the model must write them in)."""
    value: Any = getattr(so, so.kind)
    if so.kind == "json":
        value = _parse_schema(value)
    return json.dumps(
        [so.kind, value, so.strict, so.disable_any_whitespace], separators=(",", ":"), ensure_ascii=False
    )


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of the strings (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_tokenizer_info(tokenizer: Any, vocab_size: int | None, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of an HF tokenizer. vocab_size is the model's logit width (it may exceed the
    tokenizer's: the padding ids are never allowed); stop ids are the tokens a grammar may end with."""
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
    )


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer, thread-safely, with an LRU keyed by
    canonical_key. compile() raises ValueError naming the invalid or unsupported construct."""

    def __init__(self, tokenizer_info: Any, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer_info = tokenizer_info
        # Our LRU is the one cache (bounded by entries); xgrammar's own would grow without a count bound.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self.num_compiles = 0  # cache misses, for tests and the benchmark

    def compile(self, so: StructuredOutputsParams) -> Any:
        key = canonical_key(so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile_uncached(so)
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._cache)

    def _compile_uncached(self, so: StructuredOutputsParams) -> Any:
        kind = so.kind
        c = self._compiler
        try:
            if kind == "json":
                schema = json.dumps(_parse_schema(so.json))
                return c.compile_json_schema(
                    schema, any_whitespace=not so.disable_any_whitespace, strict_mode=so.strict
                )
            if kind == "json_object":
                # Any object: a non-strict {"type": "object"} allows every property (strict would allow only {}).
                return c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not so.disable_any_whitespace, strict_mode=False
                )
            if kind == "regex":
                return c.compile_regex(so.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(so.choice))
            return c.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {
                "json": "JSON schema",
                "json_object": "JSON object grammar",
                "regex": "regex",
                "choice": "choice",
                "grammar": "grammar",
            }[kind]
            raise ValueError(f"structured_outputs.{kind}: invalid or unsupported {what}: {_clean(e)}") from e


def _parse_schema(schema: dict[str, Any] | str) -> Any:
    if isinstance(schema, dict):
        return schema
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {e}") from e
    if not isinstance(parsed, dict | bool):
        raise ValueError(
            f"structured_outputs.json: a JSON schema must be an object or a boolean, got {type(parsed).__name__}"
        )
    return parsed


def _clean(e: Exception) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return _CPP_PREFIX.sub("", first) or type(e).__name__


# (id(tokenizer), vocab_size) -> (the tokenizer, kept alive so its id is never reused; its compiler)
_compilers: dict[tuple[int, int | None], tuple[Any, GrammarCompiler]] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int | None, stop_token_ids: Sequence[int]) -> GrammarCompiler:
    """The compiler for this tokenizer object (built once: building xgrammar's tokenizer info takes about
    a second for a 49k vocabulary). The API process calls this with vocab_size=None (validation only)."""
    key = (id(tokenizer), vocab_size)
    with _compilers_lock:
        entry = _compilers.get(key)
        if entry is None:
            entry = (tokenizer, GrammarCompiler(build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)))
            _compilers[key] = entry
        return entry[1]


def validate_structured_outputs(
    so: StructuredOutputsParams, tokenizer: Any, stop_token_ids: Sequence[int] = ()
) -> None:
    """For the API process, before admission: compile (or find in the cache) and raise ValueError naming
    the unsupported or invalid construct. Blocking (up to ~a second for a large schema, more for the first
    call on a tokenizer): call it from a worker thread, e.g. `await asyncio.to_thread(...)`."""
    compiler_for(tokenizer, None, stop_token_ids).compile(so)
