"""The Hub stand-in for e2e tests: tests/hub_standin.py (the one stand-in; its docstring is the API), re-exported,
with tests/half_checkpoints.py's cast_checkpoint (the bf16 repo the stand-in serves beside the GGUF conversion).

Loaded by file path so that e2e/ and tests/ can both be on sys.path in one pytest session.
"""

import importlib.util
import pathlib
import sys

_NAME = "tokenmill_tests_hub_standin"
_PATH = pathlib.Path(__file__).resolve().parents[1] / "tests" / "hub_standin.py"
STANDIN_SCRIPT = _PATH  # run as a process: python STANDIN_SCRIPT --root DIR --port P ...

_HALF_NAME = "tokenmill_tests_half_checkpoints"
_HALF_PATH = _PATH.with_name("half_checkpoints.py")


def _load(name: str, path: pathlib.Path) -> object:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


HubStandin = _load(_NAME, _PATH).HubStandin
RequestRecord = _load(_NAME, _PATH).RequestRecord


def cast_checkpoint(src: pathlib.Path, dst: pathlib.Path, dtype: str) -> pathlib.Path:
    """tests/half_checkpoints.py's: src's weights stored in dtype as Hub repos are (imports torch, so on call)."""
    return _load(_HALF_NAME, _HALF_PATH).cast_checkpoint(src, dst, dtype)
