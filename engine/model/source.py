"""Where a model comes from: the URI forms a model argument takes, parsed (resolve.py gets it onto disk).

Accepted forms (the operator's `spec.model.uri` and the engine's `--model`, `LLM(model=...)`):
- `hf://ORG/NAME[@REVISION]`: a Hugging Face Hub repo at a branch, tag or commit sha (default `main`).
- `ORG/NAME`: the same, as vLLM takes it, when no local file or folder has that name.
- `pvc://CLAIM/PATH`: `$TOKENMILL_PVC_ROOT/CLAIM/PATH`; the root defaults to /models, where the operator
  mounts the claim (read-only, at /models/CLAIM: the operator's children/model_source.py MODELS_DIR).
- `file:///PATH`: a folder or .gguf file baked into the image.
- `bundled://smollm2-135m-instruct` (or no model at all): the bundled SmolLM2-135M-Instruct GGUF.
- anything else: a local Hugging Face folder or .gguf file.

Hub downloads (hub_download.py) go through huggingface_hub into its cache (`HF_HUB_CACHE`, else `HF_HOME`/hub, else
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

from tokenmill.engine.model.bundled import BUNDLED_MODEL

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
