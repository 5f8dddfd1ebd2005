"""The server's LoRA adapters (vLLM's OpenAIServingModels, for adapters): the names clients send as
`model`, each a LoRARequest with an id of its own; `--lora-modules` at start-up and, behind
`--allow-runtime-lora-updating` (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), /v1/load_lora_adapter
and /v1/unload_lora_adapter at run time; and `--lora-modules-file`, a JSON list the server reads before it
is ready and again whenever it changes (the operator's ConfigMap: adapters come and go without a restart).

An adapter is checked here before it is registered (lora/peft.py: files, rank, targets and shapes
against the base model; torch-free), so a bad one is a 400 that names the problem, not a failed request
later. A path may be a local folder or any model URI the engine takes (hf://ORG/NAME[@REV], pvc://,
file://): hub adapters are downloaded into the same hub cache as models.
"""

import itertools
import json
import os
import pathlib
from dataclasses import dataclass, field

from tokenmill.engine.lora.peft import LoRAAdapterError, check_lora_name, read_adapter
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.server.errors import OpenAIError

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, honoured as well as the flag


def runtime_updates_allowed(flag: bool, environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return flag or env.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class LoRAModule:
    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModule:
    """vLLM's two forms: name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f'--lora-modules {text!r}: the JSON form needs "name" and "path" strings')
        return LoRAModule(obj["name"], obj["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected NAME=PATH or a JSON object")
    return LoRAModule(name, path)


def resolve_adapter_path(path: str) -> pathlib.Path:
    """A local folder for an adapter path or URI (downloads a hub adapter into the hub cache)."""
    from tokenmill.engine.model.resolve import resolve_adapter

    return resolve_adapter(path)


@dataclass
class LoRAServing:
    base_name: str
    model_config: ModelConfig
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    allow_runtime_updates: bool
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    # --lora-modules-file: name -> path of what the file lists, and why those that failed did
    from_file: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def check_new(self, name: str, reserved: set[str]) -> None:
        """Refuse a name that is invalid, taken by an adapter, or one of the base model's names (400)."""
        try:
            check_lora_name(name)
        except LoRAAdapterError as e:
            raise OpenAIError(400, str(e), param="lora_name") from None
        if name in self.adapters or name in reserved:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")

    def load(self, name: str, path: str, reserved: set[str]) -> LoRARequest:
        """Check and register an adapter (blocking: may download; call it in a thread). A new id every
        time, so a reloaded name never meets its earlier version's cached blocks or weights."""
        self.check_new(name, reserved)
        try:
            folder = resolve_adapter_path(path)
            read_adapter(folder, self.model_config, self.max_lora_rank, name)
        except (ValueError, FileNotFoundError) as e:  # LoRAAdapterError, ModelSourceError: the caller's to fix
            raise OpenAIError(400, str(e), param="lora_path") from None
        self.check_new(name, reserved)  # a concurrent load of the same name may have won meanwhile
        # A URI travels as written: every rank resolves it itself (a hub adapter in its own hub cache: a rank
        # on another node has no copy of this one's; pvc:// under its own mount); a local folder as its
        # absolute path (the other ranks run with cwd /).
        local = os.path.exists(path)
        lora = LoRARequest(name, next(self._ids), str(folder.resolve()) if local else path)
        self.adapters[name] = lora
        return lora

    def sync_file(self, modules: list[LoRAModule], reserved: set[str], retry_failed: bool) -> bool:
        """Make the adapters the file listed before match `modules` (blocking: loads may download). An
        adapter that fails stays out, with its reason in `failed`, and is tried again when its entry
        changes (or retry_failed). Whether anything changed."""
        want = {m.name: m.path for m in modules}
        changed = False
        for name, path in list(self.from_file.items()):
            if want.get(name) != path:
                self.adapters.pop(name, None)
                self.failed.pop(name, None)
                del self.from_file[name]
                changed = True
        for name, path in want.items():
            if name in self.from_file and not (retry_failed and name in self.failed):
                continue
            self.from_file[name] = path
            self.failed.pop(name, None)
            try:
                self.load(name, path, reserved)
            except OpenAIError as e:
                self.failed[name] = e.message
            changed = True
        return changed

    def unload(self, name: str) -> None:
        """Forget an adapter: new requests naming it get 404; requests already running finish under it."""
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="model_not_found")  # fmt: skip


def read_lora_modules_file(path: str) -> list[LoRAModule]:
    """--lora-modules-file: a JSON list of {"name", "path"} (vLLM's --lora-modules JSON form, one per entry)."""
    with open(path) as f:
        raw = f.read()
    try:
        entries = json.loads(raw) if raw.strip() else []
    except ValueError as e:
        raise ValueError(f"--lora-modules-file {path}: not valid JSON ({e})") from None
    if not isinstance(entries, list):
        raise ValueError(f"--lora-modules-file {path}: expected a JSON list of {{\"name\", \"path\"}} objects")
    return [parse_lora_module(json.dumps(e)) for e in entries]
