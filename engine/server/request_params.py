"""Request -> SamplingParams: OpenAI and vLLM request fields mapped to the engine's parameters, and the
completion budget (max_tokens) checked against the context length. Every bad value is a 400 naming the
parameter."""

from typing import Any

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.errors import bad_request, from_value_error

SAMPLING_PARAM_NAMES = {f for f in SamplingParams.__dataclass_fields__} | {
    "max_completion_tokens",
    "top_logprobs",
}
MAX_LOGPROBS = 20  # OpenAI's limit for logprobs (completions) and top_logprobs (chat)


def chat_sampling_params(
    req: Any, max_num_seqs: int, vocab_size: int, defaults: dict[str, Any] | None = None
) -> tuple[SamplingParams, str]:
    """A chat request's parameters, and the name of the field that set the completion budget
    (max_completion_tokens, or the deprecated max_tokens) for the length error to name."""
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
            )
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = build_sampling_params(
        req,
        n=1 if req.n is None else req.n,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        max_num_seqs=max_num_seqs,
        vocab_size=vocab_size,
        defaults=defaults,
    )
    return params, max_tokens_param


def completion_sampling_params(
    req: Any, max_num_seqs: int, vocab_size: int, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    n = 1 if req.n is None else req.n
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != n:
        raise bad_request(f"best_of must equal n ({n}) on this server, got {req.best_of}", "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    return build_sampling_params(
        req, n=n, logprobs=req.logprobs, max_tokens=req.max_tokens, max_num_seqs=max_num_seqs,
        vocab_size=vocab_size, defaults=defaults,
    )  # fmt: skip


def finish_params(
    params: SamplingParams,
    prompt_len: int,
    max_model_len: int,
    prompt_param: str,
    max_tokens_param: str,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """Once the prompt's length is known: the completion budget (the requested max_tokens, else the
    model's default capped at the room left, else all the room left), then the full check."""
    requested = params.max_tokens
    params.max_tokens = resolve_max_tokens(
        prompt_len, requested, max_model_len, prompt_param, max_tokens_param
    )
    if requested is None and default_max_tokens is not None:
        params.max_tokens = min(params.max_tokens, default_max_tokens)
    try:
        params.verify()
    except ValueError as e:
        raise from_value_error(e, SAMPLING_PARAM_NAMES) from None
    return params


def build_sampling_params(
    req: Any,
    *,
    n: int,
    logprobs: int | None,
    max_tokens: int | None,
    max_num_seqs: int,
    vocab_size: int,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """OpenAI + vLLM request fields -> SamplingParams; every bad value is a 400 naming the parameter.
    A field the request leaves out takes the server's default (the model's generation config), then
    the engine's."""
    defaults = defaults or {}

    def pick(value: Any, name: str, engine_default: Any) -> Any:
        return value if value is not None else defaults.get(name, engine_default)

    if n > max_num_seqs:
        raise bad_request(f"n must be at most max_num_seqs ({max_num_seqs}) on this server, got {n}", "n")
    logit_bias: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias key {token} is not a token id in [0, {vocab_size})", "logit_bias")
        logit_bias[token] = bias
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"stop_token_ids must be token ids in [0, {vocab_size}); got {bad[:5]}", "stop_token_ids"
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kwargs: dict[str, Any] = {
        "n": n,
        "temperature": pick(req.temperature, "temperature", 1.0),
        "top_p": pick(req.top_p, "top_p", 1.0),
        "top_k": pick(req.top_k, "top_k", 0),
        "min_p": pick(req.min_p, "min_p", 0.0),
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": pick(req.repetition_penalty, "repetition_penalty", 1.0),
        "seed": req.seed,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens or 0,
        "ignore_eos": bool(req.ignore_eos),
        "logprobs": logprobs,
        "logit_bias": logit_bias,
        "skip_special_tokens": True if req.skip_special_tokens is None else req.skip_special_tokens,
    }
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_PARAM_NAMES) from None


def resolve_max_tokens(
    prompt_len: int, requested: int | None, max_model_len: int, prompt_param: str, max_tokens_param: str
) -> int:
    """The completion budget; a 400 naming both lengths when the prompt (plus max_tokens) does not fit."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"the prompt has {prompt_len} tokens, but this model's maximum context length (max_model_len) is "
            f"{max_model_len} tokens, which leaves no room for a completion; shorten the prompt",
            prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"this model's maximum context length (max_model_len) is {max_model_len} tokens, but "
            f"{prompt_len + requested} were requested ({prompt_len} in the prompt, {requested} for the "
            f"completion); set {max_tokens_param} to at most {room} or shorten the prompt",
            max_tokens_param,
        )
    return requested
