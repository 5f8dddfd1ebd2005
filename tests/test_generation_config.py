"""Default sampling from the model's generation config (engine/frontend/generation_config.py) and how requests
override it (engine/server/request_params.py). No model: folders written here, requests built
with the real protocol classes. The real-server check (README's example) is in test_server_openai.py."""

import json
import types

import pytest
from tokenmill.engine.cli import serve as serve_cli
from tokenmill.engine.frontend.generation_config import default_sampling_params, describe, parse_override
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.server.errors import OpenAIError
from tokenmill.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.engine.server.request_params import (
    chat_sampling_params,
    completion_sampling_params,
    finish_params,
)

QWEN_LIKE = {  # the shape of Qwen2.5-Instruct's generation_config.json
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "max_new_tokens": 2048,
}


def _folder(tmp_path, name, config):
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(config))
    return d


def test_auto_reads_the_folder_and_maps_max_new_tokens(tmp_path):
    d = _folder(tmp_path, "m", QWEN_LIKE)
    defaults, source = default_sampling_params("auto", d, bundled=False)
    assert defaults == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 2048,
    }  # fmt: skip
    assert str(d) in source
    assert "temperature=0.7" in describe(defaults, source)


def test_vllm_mode_ignores_the_folder_but_keeps_overrides(tmp_path):
    d = _folder(tmp_path, "m", QWEN_LIKE)
    assert default_sampling_params("vllm", d, bundled=False) == (
        {},
        "the engine's defaults (--generation-config vllm)",
    )
    defaults, source = default_sampling_params("vllm", d, bundled=True, override={"temperature": 0.5})
    assert defaults == {"temperature": 0.5} and "override" in source


def test_bundled_model_gets_its_card_values_with_auto_only_when_the_folder_has_none(tmp_path):
    tokens_only = _folder(tmp_path, "converted", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    defaults, source = default_sampling_params("auto", tokens_only, bundled=True)
    # SmolLM2-135M-Instruct's model card: generate(..., temperature=0.2, top_p=0.9, do_sample=True).
    assert defaults == {"temperature": 0.2, "top_p": 0.9} and "card" in source
    assert default_sampling_params("auto", tokens_only, bundled=False)[0] == {}
    with_values = _folder(tmp_path, "own", {"temperature": 0.6})
    assert default_sampling_params("auto", with_values, bundled=True)[0] == {"temperature": 0.6}


def test_unset_is_greedy_for_the_bundled_model_and_auto_for_others(tmp_path):
    """docs/serving.md: without --generation-config the bundled model decodes greedily (temperature 0);
    any other model gets `auto`, vLLM's default. The override is still laid over either."""
    tokens_only = _folder(tmp_path, "converted", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    defaults, source = default_sampling_params(None, tokens_only, bundled=True)
    assert defaults == {"temperature": 0.0}
    assert "greedy" in source and "--generation-config auto" in source
    assert SamplingParams(**defaults).greedy
    defaults, source = default_sampling_params(None, tokens_only, bundled=True, override={"max_new_tokens": 256})
    assert defaults == {"temperature": 0.0, "max_tokens": 256} and "override" in source
    qwen = _folder(tmp_path, "qwen", QWEN_LIKE)
    assert default_sampling_params(None, qwen, bundled=False) == default_sampling_params("auto", qwen, bundled=False)
    assert default_sampling_params(None, tokens_only, bundled=False)[0] == {}


def test_folder_mode_and_override_layering(tmp_path):
    model = _folder(tmp_path, "model", {"temperature": 0.9})
    other = _folder(tmp_path, "other", QWEN_LIKE)
    defaults, _ = default_sampling_params(str(other), model, bundled=False, override={"top_k": 5})
    assert defaults["temperature"] == 0.7 and defaults["top_k"] == 5
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        default_sampling_params(str(tmp_path / "missing"), model, bundled=False)


def test_override_flag_is_checked_at_parse_time(capsys):
    args = serve_cli.parse_args(["--override-generation-config", '{"temperature": 0.3}'], environ={})
    assert args.override_generation_config == {"temperature": 0.3} and args.generation_config is None
    assert serve_cli.parse_args(["--generation-config", "auto"], environ={}).generation_config == "auto"
    env = {"TOKENMILL_GENERATION_CONFIG": "vllm"}
    assert serve_cli.parse_args([], environ=env).generation_config == "vllm"
    for bad, needle in [
        ('{"temp": 1}', "unknown keys ['temp']"),
        ("[1]", "JSON object"),
        ("{", "valid JSON"),
    ]:
        with pytest.raises(SystemExit) as e:
            serve_cli.parse_args(["--override-generation-config", bad], environ={})
        assert e.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown keys"):
        parse_override('{"do_sample": false}')


def test_request_values_win_over_defaults_and_defaults_fill_the_rest():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "max_tokens": 50}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0)
    params, _ = chat_sampling_params(req, max_num_seqs=4, vocab_size=100, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 20)
    # No max_tokens in the request: the model's default, capped by the room left in the context.
    assert finish_params(params, 10, 400, "messages", "max_tokens", 50).max_tokens == 50
    params, _ = chat_sampling_params(req, max_num_seqs=4, vocab_size=100, defaults=defaults)
    assert finish_params(params, 380, 400, "messages", "max_tokens", 50).max_tokens == 20
    # A request's own max_tokens wins (and is still checked against the context).
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=300)
    params, _ = chat_sampling_params(req, max_num_seqs=4, vocab_size=100, defaults=defaults)
    assert finish_params(params, 10, 400, "messages", "max_completion_tokens", 50).max_tokens == 300
    comp = completion_sampling_params(
        CompletionRequest(prompt="x", top_p=0.5), max_num_seqs=4, vocab_size=100, defaults=defaults
    )
    assert (comp.temperature, comp.top_p, comp.max_tokens) == (0.2, 0.5, 16)  # OpenAI's completions default


def test_no_defaults_keeps_the_engine_defaults():
    req = types.SimpleNamespace(**ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).__dict__)
    params, _ = chat_sampling_params(req, max_num_seqs=4, vocab_size=100)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_an_out_of_range_request_value_is_still_a_400_with_defaults():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_p=1.5)
    with pytest.raises(OpenAIError) as e:
        chat_sampling_params(req, max_num_seqs=4, vocab_size=100, defaults={"top_p": 0.9})
    assert e.value.status == 400 and e.value.param == "top_p"


def test_offline_llm_with_auto_uses_the_model_cards_values_when_no_params_are_given():
    """`generation_config="auto"` (as `--generation-config auto`) gives the bundled model its card's values,
    and leaving the parameters out samples exactly as spelling them out does."""
    import torch
    from tokenmill.engine import LLM

    # No prefix cache: both calls below compute the prompt the same way.
    llm = LLM(
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=16,
        enable_prefix_caching=False,
        generation_config="auto",
        override_generation_config={"max_new_tokens": 12},
    )
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 12)
    assert "card" in llm.default_sampling_source
    france = [{"role": "user", "content": "What is the capital of France?"}]
    # The same state of the global generator (unseeded requests draw from it) for both calls.
    torch.manual_seed(1234)
    implicit = llm.chat(france, use_tqdm=False)[0].outputs[0]
    torch.manual_seed(1234)
    explicit = llm.chat(
        france, SamplingParams(temperature=0.2, top_p=0.9, max_tokens=12), use_tqdm=False
    )[0].outputs[0]
    assert implicit.token_ids == explicit.token_ids and len(implicit.token_ids) <= 12
