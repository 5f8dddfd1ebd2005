"""Hugging Face Hub models onto local disk: through huggingface_hub into its cache (`HF_HUB_CACHE`, else
`HF_HOME`/hub, else ~/.cache/huggingface/hub), from `HF_ENDPOINT`, with `HF_TOKEN`. Only what the engine
loads is fetched (source.py's ALLOW_PATTERNS). Offline first: a snapshot the cache already holds
completely is used without any network request. Every client error becomes one line naming the repo.
huggingface_hub is imported only when a download runs.
"""

import os
import pathlib
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.hub_client import ENGINE_CLIENT, hub_client
from tokenmill.engine.model.source import ALLOW_PATTERNS, IGNORE_PATTERNS, ModelSource, ModelSourceError


@dataclass(frozen=True, slots=True)
class HubSettings:
    endpoint: str
    token: str | None
    cache_dir: pathlib.Path



def hub_settings() -> HubSettings:
    """HF_ENDPOINT, HF_TOKEN, HF_HUB_CACHE / HF_HOME read now (huggingface_hub reads some at import)."""
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN") or None
    cache = os.environ.get("HF_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
        )
        cache = os.path.join(home, "hub")
    return HubSettings(endpoint, token, pathlib.Path(cache).expanduser())



def download_hf(
    source: ModelSource, *, config_only: bool = False, progress: bool = False, allow_patterns: list[str] | None = None
) -> pathlib.Path:
    """The snapshot folder of `source` in the hub cache, downloading what is missing (see module doc).
    allow_patterns: the files to fetch instead of a model's (a LoRA adapter's: model/resolve.py)."""
    import huggingface_hub as hf

    hub = hub_settings()
    kw: dict[str, Any] = dict(
        repo_id=source.repo_id, revision=source.revision, cache_dir=hub.cache_dir, endpoint=hub.endpoint,
        token=hub.token,  # None: the client's own lookup (a stored `hf auth login` token)
        **hub_client(ENGINE_CLIENT),
    )  # fmt: skip
    try:
        if config_only:
            try:
                return pathlib.Path(
                    hf.hf_hub_download(filename="config.json", local_files_only=True, **kw)
                ).parent
            except hf.errors.LocalEntryNotFoundError:
                pass
            return pathlib.Path(hf.hf_hub_download(filename="config.json", **kw)).parent
        snapshot_kw = dict(kw, allow_patterns=allow_patterns or ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
        cached = _complete_cached_snapshot(hf, snapshot_kw)
        if cached is not None:
            return cached
        bars: dict[str, Any] = {} if progress else {"tqdm_class": _silent_tqdm()}
        folder = pathlib.Path(hf.snapshot_download(**snapshot_kw, **bars))
    except Exception as e:  # the client raises many types; each becomes one line naming the repo
        raise _hub_error(e, source, hub) from e
    if not any(folder.glob("*.safetensors")):
        raise ModelSourceError(
            f"{source.display} on {hub.endpoint} has no *.safetensors weights at the top level (the engine "
            "loads safetensors only; convert the checkpoint or pick a repo that has them)"
        )
    return folder



def _complete_cached_snapshot(hf: Any, kw: dict[str, Any]) -> pathlib.Path | None:
    """The cached snapshot when the cache holds every wanted file, with no network request; else None.

    huggingface_hub checks completeness against the tree listing it cached with the snapshot; a folder
    without that listing (e.g. config.json alone, from `--check`) is not trusted as complete.
    """
    try:
        folder = pathlib.Path(hf.snapshot_download(**kw, local_files_only=True))
        hf.get_cached_repo_tree(kw["repo_id"], revision=folder.name, cache_dir=kw["cache_dir"])
    except (hf.errors.LocalEntryNotFoundError, hf.errors.CachedRepoTreeNotFoundError, OSError):
        return None  # IncompleteSnapshotError is a LocalEntryNotFoundError
    return folder



def _silent_tqdm() -> type:
    from tqdm.auto import tqdm

    class Silent(tqdm):  # huggingface_hub builds every bar of a snapshot from this class
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent



def _hub_error(e: Exception, source: ModelSource, hub: HubSettings) -> ModelSourceError:
    from huggingface_hub import errors

    repo, where = source.display, hub.endpoint
    if isinstance(e, errors.GatedRepoError):
        if hub.token is None:
            return ModelSourceError(
                f"{repo} is a gated repo on {where}: set HF_TOKEN to a token of an account that was granted access"
            )
        return ModelSourceError(
            f"{repo} is a gated repo on {where} and the token in HF_TOKEN has no access: request access at "
            f"{where}/{source.repo_id} or use another token"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return ModelSourceError(
            f"revision {source.revision!r} not found in {source.repo_id} on {where}: use an existing branch, tag "
            "or full commit sha"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        token = "" if hub.token else "; if it is private, set HF_TOKEN"
        return ModelSourceError(f"repo {source.repo_id} not found on {where}: check the name{token}")
    if isinstance(e, errors.RemoteEntryNotFoundError):
        return ModelSourceError(
            f"{repo} on {where} has no config.json: is it a Hugging Face transformers model?"
        )
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
        return ModelSourceError(
            f"downloading {repo} from {where} failed: HTTP {e.response.status_code}; retry, or check HF_ENDPOINT"
        )
    if isinstance(e, errors.LocalEntryNotFoundError):
        cause = e.__cause__ or e.__context__
        why = f" ({type(cause).__name__}: {str(cause).splitlines()[0]})" if cause is not None else ""
        return ModelSourceError(
            f"cannot reach {where} to download {repo}{why} and the cache {hub.cache_dir} does not hold it: "
            "check the network and HF_ENDPOINT, or fill the cache first (tokenmill download)"
        )
    first_line = (str(e).splitlines() or [""])[0]
    return ModelSourceError(f"downloading {repo} from {where} failed: {type(e).__name__}: {first_line}")
