"""The C++ CPU kernels (kernels/csrc/): built on first use with torch.utils.cpp_extension, cached.

The build goes to torch's extension cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR) under a
name that hashes the source and this machine's CPU flags, so a second process loads the .so in
milliseconds and a machine with other CPU features never loads a binary built with -march=native
elsewhere. When the build fails (no C++ compiler, no ninja) the failure is logged once and callers
fall back to the torch reference; TOKENMILL_CPU_KERNELS=0 turns the kernels off on purpose.
"""

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / "cpu_attention.cpp",
    _CSRC / "cpu_layers.cpp",
    _CSRC / "cpu_linear.cpp",
    _CSRC / "cpu_gemm.cpp",
]
_HEADERS = [_CSRC / "cpu_common.h"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the loaded op namespace, or "error": why it is unavailable


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_name() -> str:
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    digest.update(_cpu_flags().encode() + torch.__version__.encode())
    return f"tokenmill_cpu_{digest.hexdigest()[:16]}"


def enabled() -> bool:
    return os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0"


def load() -> object | None:
    """The `torch.ops.tokenmill_cpu` namespace, building it the first time; None when unavailable."""
    if "ops" in _state:
        return _state["ops"]
    if "error" in _state or not enabled():
        return None
    with _lock:
        if "ops" in _state or "error" in _state:
            return _state.get("ops")
        try:
            from torch.utils.cpp_extension import load as load_extension

            # The `ninja` wheel (an engine dependency) installs next to this interpreter, which is not on
            # PATH when the venv is not activated; torch looks ninja up on PATH.
            bin_dir = os.path.dirname(sys.executable)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

            load_extension(
                name=_build_name(),
                sources=[str(p) for p in _SOURCES],
                # fp-contract=off: no FMA contraction where transformers rounds a product (fp32 parity).
                extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"],
                is_python_module=False,
                verbose=False,
            )
            _state["ops"] = torch.ops.tokenmill_cpu
        except Exception as e:  # any build failure means: use the torch reference
            _state["error"] = f"{type(e).__name__}: {e}"
            logger.warning("C++ CPU kernels unavailable, using the torch reference: %s", _state["error"])
            return None
    return _state["ops"]


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    return _state.get("error")  # type: ignore[return-value]
