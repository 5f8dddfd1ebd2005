"""The operator's Hub cache keys by which token asked, never by whether one was given: with the real
huggingface_hub client against the Hub stand-in (tests/hub_standin.py), a token that was not granted a
gated repo is refused even after a granted one's answer is cached, and no token is a key of its own."""

import json

import pytest
from hub_standin import HubStandin
from test_operator_hub import CONFIG, NS, SecretApi, add_isvc, cond, hf_spec, reconcile
from tokenmill.operator import reconcile as rec
from tokenmill.operator.observe.hub import HubCache, HubError

GATED = "acme/gated-chat"


@pytest.fixture
def hub(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    with HubStandin() as hub:
        hub.add_repo(GATED, folder, gated=True, tokens=("hf_granted",))
        yield hub


def config_asks(hub) -> int:
    """Requests for the gated config.json (HEAD or GET): the one question only a granted token passes."""
    return sum(1 for r in hub.requests(GATED) if r.filename == "config.json")


def test_a_granted_tokens_answer_is_not_given_to_another_token_or_to_none(hub, tmp_path):
    cache = HubCache(cache_dir=str(tmp_path / "hf"))
    granted = cache.lookup(GATED, None, "hf_granted", hub.url, with_config=True)
    assert granted.gated is True and granted.config["num_hidden_layers"] == CONFIG["num_hidden_layers"]
    assert (asked := config_asks(hub)) >= 1
    for token, words in (("hf_other", "has not been granted access"), (None, "is gated: create a Secret")):
        with pytest.raises(HubError) as e:
            cache.lookup(GATED, None, token, hub.url, with_config=True)
        assert e.value.reason == "GatedModel" and words in str(e.value), str(e.value)
    assert config_asks(hub) > asked  # hf_other asked the Hub for itself (and was refused)
    asked = config_asks(hub)
    # Each answer is cached under its own token: asking again asks the Hub nothing.
    assert cache.lookup(GATED, None, "hf_granted", hub.url, with_config=True) is granted
    with pytest.raises(HubError):
        cache.lookup(GATED, None, "hf_other", hub.url, with_config=True)
    assert config_asks(hub) == asked
    assert len(cache._entries) == 3


def test_tokens_are_kept_as_keyed_hashes_only():
    calls = []

    def fetcher(repo, revision, token, endpoint, with_config, cache_dir=None):
        calls.append(token)
        return f"answer for {token}"

    cache, other = HubCache(fetcher=fetcher), HubCache(fetcher=fetcher)
    for token in ("hf_a", "hf_b", None, "hf_a", "hf_b", None):
        assert cache.lookup("a/b", None, token, None, True) == f"answer for {token}"
    assert calls == ["hf_a", "hf_b", None]
    keys = repr(list(cache._entries))
    assert "hf_a" not in keys and "hf_b" not in keys
    assert cache.token_id("hf_a") == cache.token_id("hf_a") != cache.token_id("hf_b")
    assert cache.token_id(None) is None and cache.token_id("") is None
    # Another process (another operator, another cache) draws another key: its names for a token differ.
    assert cache.token_id("hf_a") != other.token_id("hf_a")


def test_expired_answers_are_dropped_so_rotated_tokens_leave_nothing_behind():
    clock = [0.0]
    cache = HubCache(fetcher=lambda repo, rev, token, *a, **k: token, clock=lambda: clock[0])
    cache.lookup("a/b", None, "hf_old", None, True)
    clock[0] += 4000  # past an answer's lifetime
    cache.lookup("a/b", None, "hf_new", None, True)
    assert list(cache._entries) == [(None, "a/b", None, cache.token_id("hf_new"), True)]


def test_two_services_with_different_tokens_are_each_sized_with_their_own_answer(hub, tmp_path):
    """One operator, one Hub cache: the service whose Secret holds a granted token is sized; the one whose
    Secret holds another token stays GatedModel, though the same repo's answer is cached."""
    api = SecretApi()
    api.add_secret("granted", "HF_TOKEN", "hf_granted")
    api.add_secret("other", "HF_TOKEN", "hf_other")
    config = rec.OperatorConfig(hf_endpoint=hub.url, hub=HubCache(cache_dir=str(tmp_path / "hf")))
    add_isvc(api, hf_spec(f"hf://{GATED}", tokenSecretRef={"name": "granted"}), name="chat")
    add_isvc(api, hf_spec(f"hf://{GATED}", tokenSecretRef={"name": "other"}), name="second")
    first = reconcile(api, config, name="chat")
    assert cond(first, "Sized")["status"] == "True" and first["sizing"]["profileSource"] == "hub"
    second = reconcile(api, config, name="second")
    sized = cond(second, "Sized")
    assert sized["reason"] == "GatedModel" and "has not been granted access" in sized["message"], sized
    assert ("Deployment", NS, "second") not in api.objects
    for status in (first, second):
        assert "hf_granted" not in json.dumps(status) and "hf_other" not in json.dumps(status)
