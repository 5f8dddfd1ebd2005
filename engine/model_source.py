"""Where a model comes from, and getting it onto local disk.

Accepted forms (the operator's `spec.model.uri` and the engine's `--model`, `LLM(model=...)`):
- `hf://ORG/NAME[@REVISION]`: a Hugging Face Hub repo at a branch, tag or commit sha (default `main`).
- `ORG/NAME`: the same, as vLLM takes it, when no local file or folder has that name.
- `pvc://CLAIM/PATH`: `$TOKENMILL_PVC_ROOT/CLAIM/PATH`; the root defaults to /models, where the operator
  mounts the claim (read-only, at /models/CLAIM: operator/children.py MODELS_DIR).
- `file:///PATH`: a folder or .gguf file baked into the image.
- `bundled://smollm2-135m-instruct` (or no model at all): the bundled SmolLM2-135M-Instruct GGUF.
- anything else: a local Hugging Face folder or .gguf file.

Hub downloads go through huggingface_hub into its cache (`HF_HUB_CACHE`, else `HF_HOME`/hub, else
~/.cache/huggingface/hub), from `HF_ENDPOINT`, with `HF_TOKEN`. Only what the engine loads is fetched
(config, generation config, top-level safetensors and their index, tokenizer files). Offline first: a
snapshot the cache already holds completely (pinned commit, or a branch/tag whose ref the cache
recorded) is used without any network request, so restarts and replicas sharing a cache volume never
download again; a branch is therefore not re-checked for new commits once cached (pin a commit to be
explicit). Interrupted files resume with HTTP Range requests inside the client.

This module imports neither torch nor huggingface_hub at import time.
"""

from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any

BUNDLED_MODEL = "smollm2-135m-instruct"
DEFAULT_PVC_ROOT = "/models"
PVC_ROOT_ENV = "TOKENMILL_PVC_ROOT"
DEFAULT_REVISION = "main"

# What the engine reads from a repo. Top level only: repos also carry original/ or onnx/ copies.
CONFIG_FILES = ("config.json", "generation_config.json")
WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
ALLOW_PATTERNS = [*CONFIG_FILES, *WEIGHT_PATTERNS, *TOKENIZER_FILES]
IGNORE_PATTERNS = ["*/*"]  # fnmatch's * crosses '/': this keeps subfolders out

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")


class ModelSourceError(ValueError):
    """A model that cannot be found or fetched; the message is one line that says what to fix."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    scheme: str  # "hf" | "pvc" | "file" | "bundled" | "path"
    uri: str  # as given
    repo_id: str | None = None  # hf
    revision: str | None = None  # hf: branch, tag or commit sha
    path: pathlib.Path | None = None  # pvc, file, path

    @property
    def display(self) -> str:
        if self.scheme == "hf":
            return f"hf://{self.repo_id}@{self.revision}"
        if self.scheme == "bundled":
            return f"bundled://{BUNDLED_MODEL}"
        return self.uri

    @property
    def default_served_name(self) -> str:
        """The name clients use when --served-model-name is not given: the repo id for hub models."""
        if self.scheme == "hf":
            return str(self.repo_id)
        if self.scheme == "bundled":
            return BUNDLED_MODEL
        return self.uri


def pvc_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get(PVC_ROOT_ENV) or DEFAULT_PVC_ROOT)


def parse_model_source(model: str | os.PathLike | None, revision: str | None = None) -> ModelSource:
    """Classify `model`; `revision` (e.g. --revision) must agree with an `@REVISION` in the URI."""
    if model is None or str(model) == "":
        return _with_revision(ModelSource("bundled", f"bundled://{BUNDLED_MODEL}"), revision)
    text = str(model)
    m = _SCHEME.match(text)
    if m is None:
        if _REPO_ID.match(text) and not os.path.exists(os.path.expanduser(text)):
            return _hf_source(text, text, revision)
        return _with_revision(ModelSource("path", text, path=pathlib.Path(text).expanduser()), revision)
    scheme, rest = m.group(1), m.group(2)
    if scheme == "hf":
        return _hf_source(text, rest, revision)
    if scheme == "pvc":
        claim, _, sub = rest.strip("/").partition("/")
        if not claim or not sub.strip("/"):
            raise ModelSourceError(f"model {text!r}: expected pvc://CLAIM/PATH (a folder inside the claim)")
        return _with_revision(ModelSource("pvc", text, path=pvc_root() / claim / sub.strip("/")), revision)
    if scheme == "file":
        if not rest.startswith("/"):
            raise ModelSourceError(f"model {text!r}: expected file:///ABSOLUTE/PATH (three slashes)")
        return _with_revision(ModelSource("file", text, path=pathlib.Path(rest)), revision)
    if scheme == "bundled":
        if rest.strip("/") != BUNDLED_MODEL:
            raise ModelSourceError(f"model {text!r}: the only bundled model is bundled://{BUNDLED_MODEL}")
        return _with_revision(ModelSource("bundled", text), revision)
    raise ModelSourceError(
        f"model {text!r}: unknown scheme {scheme}://; use hf://ORG/NAME[@REVISION], pvc://CLAIM/PATH, "
        f"file:///PATH, bundled://{BUNDLED_MODEL} or a local path"
    )


def _hf_source(uri: str, rest: str, revision: str | None) -> ModelSource:
    repo_id, at, pinned = rest.partition("@")
    repo_id = repo_id.strip("/")
    if not _REPO_ID.match(repo_id):
        raise ModelSourceError(f"model {uri!r}: expected hf://ORG/NAME[@REVISION], got repo id {repo_id!r}")
    if at and not pinned:
        raise ModelSourceError(f"model {uri!r}: empty revision after '@'")
    if pinned and revision and pinned != revision:
        raise ModelSourceError(f"model {uri!r} pins revision {pinned!r} but --revision is {revision!r}")
    return ModelSource("hf", uri, repo_id=repo_id, revision=pinned or revision or DEFAULT_REVISION)


def _with_revision(source: ModelSource, revision: str | None) -> ModelSource:
    if revision:
        raise ModelSourceError(f"--revision {revision!r} applies to hub models only, not {source.uri!r}")
    return source


# ---- resolution --------------------------------------------------------------------------------
def resolve_model_source(
    source: ModelSource, *, config_only: bool = False, progress: bool = False
) -> pathlib.Path:
    """A local path for `source`: a folder (or a .gguf file for local sources) the loader can read.

    config_only: for a hub model fetch config.json alone (what `serve --check` needs, no weights).
    progress: show huggingface_hub's progress bars while downloading (`tokenmill download`).
    """
    if source.scheme == "hf":
        return download_hf(source, config_only=config_only, progress=progress)
    if source.scheme == "bundled":
        from tokenmill.engine.model_files import bundled_gguf_path, convert_gguf_cached

        return convert_gguf_cached(bundled_gguf_path())
    assert source.path is not None
    if not source.path.exists():
        if source.scheme == "pvc":
            raise FileNotFoundError(
                f"model {source.uri!r} not found: {source.path} does not exist (claims are mounted under "
                f"{pvc_root()}; set {PVC_ROOT_ENV} if yours is elsewhere)"
            )
        if source.scheme == "file":
            raise FileNotFoundError(
                f"model {source.uri!r} not found: {source.path} does not exist in this image"
            )
        raise FileNotFoundError(
            f"model {source.uri!r} not found: pass a local Hugging Face folder or a .gguf file, "
            "hf://ORG/NAME[@REVISION] or ORG/NAME"
        )
    return source.path


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


def download_hf(source: ModelSource, *, config_only: bool = False, progress: bool = False) -> pathlib.Path:
    """The snapshot folder of `source` in the hub cache, downloading what is missing (see module doc)."""
    import huggingface_hub as hf

    hub = hub_settings()
    kw: dict[str, Any] = dict(
        repo_id=source.repo_id, revision=source.revision, cache_dir=hub.cache_dir, endpoint=hub.endpoint,
        token=hub.token,  # None: the client's own lookup (a stored `hf auth login` token)
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
        snapshot_kw = dict(kw, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
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
