"""The C++ CPU kernels (kernels/csrc/): built on first use with torch.utils.cpp_extension, cached.

The build goes to torch's extension cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR) under a
name that hashes the sources, the compiler flags, torch's version and the CPU flags and tier that
kernels/cpu_probe.py reports, so a second process loads the .so directly in milliseconds (no ninja run) and a machine with other CPU
features never loads a binary built with -march=native elsewhere. When the build fails (no C++
compiler, no ninja) the failure is logged once and callers fall back to the torch reference; TOKENMILL_CPU_KERNELS=0 turns the kernels off on purpose.
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
    _CSRC / "cpu_linear_bf16.cpp",
    _CSRC / "cpu_linear_amx.cpp",
    _CSRC / "cpu_dense_bf16.cpp",
    _CSRC / "cpu_gemm_bf16.cpp",
    _CSRC / "cpu_topk.cpp",
    _CSRC / "cpu_decoder.cpp",
    _CSRC / "cpu_grouped.cpp",
    _CSRC / "cpu_codes_int8.cpp",
]
# Every header the sources include, found rather than listed: build_name hashes them, and a header left
# off a list would let an edit to it load the library built before it.
_HEADERS = sorted(_CSRC.glob("*.h"))
# fp-contract=off: no FMA contraction where transformers rounds a product (fp32 parity). -fopenmp:
# at::parallel_for is a serial loop unless the code is built with OpenMP (its header tests _OPENMP), so
# without it every kernel ran on one thread whatever torch.set_num_threads said. The link resolves
# libgomp.so.1 to the copy torch has already loaded (same soname): one OpenMP runtime and one thread
# count serve torch's ops and these kernels.
# -march comes from the probe: the machine's own CPU, or a capped tier's level (cpu_probe.py).
_CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the loaded op namespace, or "error": why it is unavailable


def _cflags() -> list[str]:
    # imported here: `python -m tokenmill.kernels.cpu_probe` runs after this package loads this module
    from tokenmill.kernels.cpu_probe import probe

    return _CFLAGS + probe().march()


def build_name() -> str:
    """Names the build by everything that shapes the binary (sources, flags, torch, CPU), so a library
    found under it is current; also the key for results that depend on the kernels' code."""
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    from tokenmill.kernels.cpu_probe import probe

    caps = probe()
    cpu = " ".join(sorted(caps.flags)) + caps.tier
    digest.update(cpu.encode() + torch.__version__.encode() + " ".join(_cflags() + _LDFLAGS).encode())
    return f"tokenmill_cpu_{digest.hexdigest()[:16]}"


def _built_library(name: str) -> Path | None:
    """The library an earlier process built under `name`, where torch.utils.cpp_extension puts it
    (its _get_build_directory, followed here without importing that module and setuptools: 0.2 s of a
    warm start); None when absent. A layout torch changes only makes this miss: load() then builds."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch._appdirs  # small; what cpp_extension.get_default_build_root asks

        if torch.version.hip is not None:
            return None
        tag = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
        cache = os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))
        root = os.path.join(cache, f"py{sys.version_info.major}{sys.version_info.minor}_{tag}")
    library = Path(root) / name / f"{name}.so"
    return library if library.is_file() else None


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
        name = build_name()
        library = _built_library(name)
        if library is not None:
            try:  # built before from these very sources and flags: no ninja run, no compiler check
                torch.ops.load_library(str(library))
                _state["ops"] = torch.ops.tokenmill_cpu
                return _state["ops"]
            except (OSError, RuntimeError) as e:
                logger.warning("cannot load the cached C++ kernels %s (%s); building them again", library, e)
        try:
            from torch.utils.cpp_extension import load as load_extension

            # The `ninja` wheel (an engine dependency) installs next to this interpreter, which is not on
            # PATH when the venv is not activated; torch looks ninja up on PATH.
            bin_dir = os.path.dirname(sys.executable)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

            load_extension(
                name=name,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=_cflags(),
                extra_ldflags=_LDFLAGS,
                is_python_module=False,
                verbose=False,
            )
            _state["ops"] = torch.ops.tokenmill_cpu
        except Exception as e:  # any build failure means: use the torch reference
            _state["error"] = f"{type(e).__name__}: {e}"
            logger.warning("C++ CPU kernels unavailable, using the torch reference: %s", _state["error"])
            return None
    return _state["ops"]


def ops_for(x: torch.Tensor) -> object | None:
    """The ops for a CPU tensor, when they built; None for a tensor on another device."""
    return load() if x.device.type == "cpu" else None


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    return _state.get("error")  # type: ignore[return-value]
