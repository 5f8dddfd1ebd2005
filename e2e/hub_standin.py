"""The Hub stand-in for e2e tests: tests/hub_standin.py (the one stand-in; its docstring is the API), re-exported.

Loaded by file path so that e2e/ and tests/ can both be on sys.path in one pytest session.
"""

import importlib.util
import pathlib
import sys

_NAME = "tokenmill_tests_hub_standin"
_PATH = pathlib.Path(__file__).resolve().parents[1] / "tests" / "hub_standin.py"
STANDIN_SCRIPT = _PATH  # run as a process: python STANDIN_SCRIPT --root DIR --port P ...

if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, _PATH)
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module  # before exec: dataclasses look their module up there
    _spec.loader.exec_module(_module)

HubStandin = sys.modules[_NAME].HubStandin
RequestRecord = sys.modules[_NAME].RequestRecord
