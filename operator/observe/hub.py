"""What the Hugging Face Hub says about an hf:// model, asked once per repo and revision and cached.

The operator needs three things before any pod starts: that the repo and revision exist and are
readable with the token it has (a gated model without one is a condition, not a crash loop), the
commit the revision points at (status says which numbers were used), and for a model the catalog
lacks its config.json plus the size and parameter count of its weights (for sizing).

One model_info call answers the first two and the weights (the API's file list with sizes and the
safetensors parameter count); config.json is one small file download, cached on disk by
huggingface_hub. Nothing else is fetched. `HF_ENDPOINT` (the operator's --hf-endpoint) points it at
another Hub, which is how the tests reach the Hub stand-in.
"""

import hashlib
import hmac
import json
import logging
import secrets
import tempfile
import threading
import time
from contextlib import nullcontext

from tokenmill.engine.hub_client import OPERATOR_CLIENT, hub_client
from tokenmill.operator.plan.observations import HubError, HubModel

log = logging.getLogger("tokenmill.operator")

HUB_TIMEOUT_SECONDS = 10.0
# A commit never changes; a branch or tag may move, so a lookup by name is redone now and then.
# A failure is retried sooner: it is often a token added or a repo made public in the meantime.
CACHE_SECONDS = 3600.0
ERROR_CACHE_SECONDS = 60.0
WEIGHT_SUFFIXES = (".safetensors",)


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    """hf://ORG/NAME[@REVISION] -> (ORG/NAME, REVISION or None)."""
    rest = uri.removeprefix("hf://")
    repo, _, revision = rest.partition("@")
    return repo.strip("/"), (revision or None)


def weights_bytes(siblings: list[tuple[str, int | None]]) -> int | None:
    """Bytes of the safetensors weights in a file list [(path, size)]. Repos that ship both the
    transformers shards and a `consolidated` copy (Mistral's) are counted once: the shards."""
    files = [(p, s) for p, s in siblings if p.endswith(WEIGHT_SUFFIXES) and "/" not in p]
    shards = [(p, s) for p, s in files if not p.startswith("consolidated")]
    chosen = shards or files
    if not chosen or any(s is None for _, s in chosen):
        return None
    return sum(s for _, s in chosen)


def fetch(repo_id: str, revision: str | None, token: str | None, endpoint: str | None, with_config: bool,
          cache_dir: str | None = None) -> HubModel:
    """Ask the Hub (or HF_ENDPOINT) about one repo at one revision; HubError says what went wrong."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub import errors as hf_errors

    where = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
    client = hub_client(OPERATOR_CLIENT)
    api = HfApi(endpoint=endpoint, token=token or False, **client)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT_SECONDS)
        gated = bool(info.gated)
        config = None
        if with_config or (gated and token):
            # Also for a gated model whose numbers the catalog has: one small file proves the token
            # is granted, where model_info (public even for gated repos) cannot. For a gated repo the
            # file is fetched into a throwaway cache every time: at a commit sha huggingface_hub answers
            # from its cache without a request, and a config.json another service's token fetched proves
            # nothing about this one's (seen in e2e: a service without a readable token went ahead).
            # (force_download would do it too, but it wraps the Hub's errors in a bare ValueError.)
            with tempfile.TemporaryDirectory(prefix="tm-gated-") if gated else nullcontext(cache_dir) as where_to:
                path = hf_hub_download(repo_id, "config.json", revision=info.sha, token=token or False,
                                       endpoint=endpoint, cache_dir=where_to, etag_timeout=HUB_TIMEOUT_SECONDS,
                                       **client)
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            if not with_config:
                config = None
        elif gated:
            raise HubError("GatedModel", f"{where} is gated: create a Secret with a Hugging Face token that was "
                                         "granted access and set spec.model.tokenSecretRef")
    except HubError:
        raise
    except hf_errors.GatedRepoError:
        if token:
            raise HubError("GatedModel", f"{where} is gated and the token in spec.model.tokenSecretRef has not "
                                         "been granted access (accept the model's terms on the Hub)") from None
        raise HubError("GatedModel", f"{where} is gated: create a Secret with a Hugging Face token that was "
                                     "granted access and set spec.model.tokenSecretRef") from None
    except hf_errors.RevisionNotFoundError:
        raise HubError("RevisionNotFound", f"{where}: revision {revision!r} does not exist in {repo_id} "
                                           "(a branch, tag or full commit sha)") from None
    except hf_errors.RepositoryNotFoundError:
        raise HubError("ModelNotFound", f"{where}: no model repository {repo_id} on the Hub (or it is private "
                                        "and spec.model.tokenSecretRef gives no token that can read it)") from None
    except hf_errors.EntryNotFoundError:
        raise HubError("ModelConfigNotFound", f"{where} has no config.json: set spec.model.profile with its "
                                              "numbers, or use a transformers model repository") from None
    except Exception as e:  # connection refused, DNS, timeouts, 5xx, garbage: all "unreachable"
        raise HubError("HubUnreachable", f"cannot ask the Hub about {where}: {type(e).__name__}: {e}") from None
    params = None
    if info.safetensors is not None and getattr(info.safetensors, "total", None):
        params = int(info.safetensors.total)
    files = [(s.rfilename, s.size) for s in info.siblings or []]
    return HubModel(repo_id=repo_id, revision=revision or "main", commit=info.sha or "", gated=gated,
                    weights_bytes=weights_bytes(files), parameters=params, config=config)


class HubCache:
    """fetch() results by (endpoint, repo, revision, which token, config wanted), errors included.

    "Which token" is an HMAC of the token under a key drawn when the cache is made, never the token: two
    services whose Secrets hold different tokens get an answer each (one token granted a gated repo says
    nothing about another), the same token shares one, and no token is one more key. The key lives only in
    this process, so a dump of the cache (or of the process's dicts) cannot be matched against a guess."""

    def __init__(self, fetcher=fetch, clock=time.monotonic, cache_dir: str | None = None):
        self.fetcher, self.clock, self.cache_dir = fetcher, clock, cache_dir
        self._entries: dict[tuple, tuple[float, HubModel | HubError]] = {}
        self._guard = threading.Lock()
        self._token_key = secrets.token_bytes(32)

    def token_id(self, token: str | None) -> str | None:
        """The cache's name for a token: None for none, else a keyed hash of it (hex)."""
        if not token:
            return None
        return hmac.new(self._token_key, token.encode(), hashlib.sha256).hexdigest()

    def lookup(self, repo_id: str, revision: str | None, token: str | None, endpoint: str | None,
               with_config: bool) -> HubModel:
        key = (endpoint, repo_id, revision, self.token_id(token), with_config)
        with self._guard:
            hit = self._entries.get(key)
        if hit is not None and hit[0] > self.clock():
            if isinstance(hit[1], HubError):
                raise hit[1]
            return hit[1]
        try:
            result = self.fetcher(repo_id, revision, token, endpoint, with_config, cache_dir=self.cache_dir)
        except HubError as e:
            log.warning("hub lookup of %s@%s: %s: %s", repo_id, revision or "main", e.reason, e)
            self._store(key, ERROR_CACHE_SECONDS, e)
            raise
        self._store(key, CACHE_SECONDS, result)
        return result

    def _store(self, key: tuple, seconds: float, answer: HubModel | HubError) -> None:
        """Keep one answer, dropping expired ones: a rotated token leaves its entries behind otherwise."""
        now = self.clock()
        with self._guard:
            for old in [k for k, (until, _) in self._entries.items() if until <= now]:
                del self._entries[old]
            self._entries[key] = (now + seconds, answer)
