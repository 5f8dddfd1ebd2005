#!/usr/bin/env bash
# The GPU session in one command, for a lent device machine (README there: python3 has torch, triton,
# transformers; tokenmill is not installed; only the repo checkout and carried folders travel).
#   bash engine/bench/gpu_session.sh        # from the repo root; results in $OUT (default /tmp/gpu_session_out)
# Needs REPO/.gpu_model (engine/bench/gpu_session_prep.sh makes it here; carry it). Wheels in REPO/.whl,
# if any, are installed to /tmp/site first. Phases, each under its own time cap, each logged to $OUT
# whatever the others do (no set -e): env, gpu_check (kernels/gpu_check.py), parity, throughput, cli, big.
# With no GPU every phase says so and the script exits 2.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/gpu_session_out}
PY=${PYTHON:-python3}
export PY
ASSETS=${ASSETS:-$REPO/.gpu_model}
MODELS=${MODELS:-/tmp/gpu_session_models}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: the whole script at tiny sizes, a test of it without a GPU
export DEVICE
BUDGET=${BUDGET:-450}  # seconds for the whole script: a phase's cap is cut to what is left of it
mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

# tokenmill is a namespace package whose import packages live in engine/, kernels/, operator/
# (pyproject's package-dir): a folder of links stands in for the install.
SHIM=/tmp/tokenmill_shim
mkdir -p "$SHIM/tokenmill"
for p in engine kernels operator; do ln -sfn "$REPO/$p" "$SHIM/tokenmill/$p"; done
PYPATH=$SHIM
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$REPO"/.whl/*.whl; then
    PYPATH=$SHIM:/tmp/site
  else
    echo "wheel install failed; going on without them" | tee -a "$SUMMARY"
  fi
fi
export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}

# phase NAME CAP_S CMD...: run CMD under a time cap, output to $OUT/NAME.log, one line to summary.txt.
phase() {
  local name=$1 cap=$2; shift 2
  local start=$(date +%s)
  local left=$((BUDGET - (start - T0)))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 15 ]; then
    echo "=== $name rc=skipped (only ${left} s of BUDGET=${BUDGET} left)" | tee -a "$SUMMARY"
    return 0
  fi
  echo "=== $name (cap ${cap} s, at +$((start - T0)) s)" | tee -a "$OUT/$name.log"
  if declare -F "$1" >/dev/null; then  # a shell function: timeout runs programs only
    export -f "$1"
    set -- bash -c '"$@"' _ "$@"
  fi
  timeout -k 10 "$cap" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  local what=ok; [ $rc -ne 0 ] && what=FAILED; [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="CUT at its cap"
  echo "=== $name rc=$rc ($what) in $(($(date +%s) - start)) s" | tee -a "$OUT/$name.log" "$SUMMARY"
  tail -n 25 "$OUT/$name.log"
}

env_report() {
  nvidia-smi || echo "nvidia-smi: not available"
  "$PY" - <<'PY'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for m in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "jinja2", "tqdm", "yaml",
          "msgpack", "zmq", "gguf", "xgrammar", "fastapi", "uvicorn"):
    try:
        print(f"  {m} {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as e:
        print(f"  {m} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available:", torch.cuda.is_available(), "| torch cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, cc {p.major}.{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
import tokenmill.engine.llm, tokenmill.kernels  # the shim works: the offline engine and the kernels import
print("tokenmill imports ok from", tokenmill.engine.llm.__file__)
PY
  [ "$DEVICE" = cpu ] || "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)'
}

phase env 30 env_report
if ! grep -q "^=== env rc=0 " "$SUMMARY"; then
  echo "no CUDA device (or env check failed): GPU phases skipped" | tee -a "$SUMMARY"
  exit 2
fi
GS=("$PY" "$REPO/engine/bench/gpu_session.py" --assets "$ASSETS" --out "$OUT" --models "$MODELS" --device "$DEVICE")
CHECK=() DATASET=random:256:128:128
if [ "$DEVICE" = cpu ]; then GS+=(--tiny); CHECK=(--cpu-smoke); DATASET=random:8:16:8; fi
phase gpu_check 140 "$PY" -m tokenmill.kernels.gpu_check "${CHECK[@]}"
phase parity 80 "${GS[@]}" parity
phase throughput 80 "${GS[@]}" throughput
# The CLI on the same folder, the engine's default KV pool (on CUDA a fraction of free GPU memory).
phase cli 45 "$PY" -m tokenmill.engine.cli bench throughput --model "$MODELS/smol-fp32" --device "$DEVICE" \
  --dtype bfloat16 --dataset "$DATASET" --no-progress --json "$MODELS/cli_bench.json"
phase big 95 "${GS[@]}" big
echo "=== total $(($(date +%s) - T0)) s" | tee -a "$SUMMARY"
cat "$SUMMARY"
! grep -q "rc=[1-9]" "$SUMMARY"
