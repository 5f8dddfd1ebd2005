"""Sampling parameters: the same names and meanings as vLLM's SamplingParams."""

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output (vLLM's name and fields). Exactly one of json, json_object, regex, choice and
    grammar is set; compiled with xgrammar by engine/structured_output/grammar.py."""

    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool | None = None  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF/GBNF as xgrammar accepts, root rule `root`
    # JSON schema only: with strict (xgrammar's strict_mode) no properties or array items beyond those
    # the schema names; without it `additionalProperties`/`items` defaults are JSON Schema's (allowed).
    strict: bool = True
    # JSON only: no whitespace between tokens (vLLM's flag); default allows any whitespace.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            self.choice = list(self.choice)
        self.verify()

    def verify(self) -> None:
        """Raise ValueError unless exactly one constraint is set and has the right shape."""
        set_fields = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        _check(
            len(set_fields) == 1,
            "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; got "
            + (", ".join(set_fields) if set_fields else "none"),
        )
        _check(
            self.json is None or isinstance(self.json, dict | str),
            f"structured_outputs.json must be a JSON schema object or string, got {type(self.json).__name__}",
        )
        _check(
            self.json_object in (None, True, False),
            f"structured_outputs.json_object must be a boolean, got {self.json_object!r}",
        )
        _check(
            self.regex is None or (isinstance(self.regex, str) and self.regex != ""),
            "structured_outputs.regex must be a non-empty string",
        )
        _check(
            self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
            "structured_outputs.grammar must be a non-empty string",
        )
        if self.choice is not None:
            _check(len(self.choice) > 0, "structured_outputs.choice must list at least one string")
            _check(
                all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice must contain only non-empty strings",
            )

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")
# A positive temperature below this is raised to it (vLLM does the same): dividing the logits by a much
# smaller one overflows float32 to inf, softmax turns the row into NaN and the sampler returned token 0
# whatever the model said (found while fuzzing a real server). At 0.01 a logit gap of 0.1 already
# makes the top token e^10 times likelier, so the request still gets what it asked for.
MIN_TEMPERATURE = 0.01


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0: only the sampled token's)
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # from_dict / msgpack across the core boundary
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the parameter and its allowed range."""
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than 0, got {self.repetition_penalty}",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _check(all(s for s in self.stop), "stop strings must not be empty")
        _check(
            self.seed is None or -(2**63) <= self.seed <= 2**63 - 1 - self.n,
            f"seed must fit in a signed 64-bit integer, got {self.seed}",
        )
        for tok, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, f"logit_bias for token {tok} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        return cls(**d)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
