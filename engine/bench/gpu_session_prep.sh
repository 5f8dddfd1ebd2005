#!/usr/bin/env bash
# Here (no GPU), before a device run of engine/bench/gpu_session.sh: copy the bundled model's small files
# (config.json, tokenizer, ~3.5 MB; the 540 MB weights stay behind) into REPO/.gpu_model, which
# .git/info/exclude ignores and the device run carries. Usage: bash engine/bench/gpu_session_prep.sh [REPO]
set -eu
REPO=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
SRC=$("$PY" -c 'from tokenmill.engine.model.resolve import resolve_model; print(resolve_model(None))' | tail -1)
mkdir -p "$REPO/.gpu_model"
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json special_tokens_map.json; do
  if [ -f "$SRC/$f" ]; then cp "$SRC/$f" "$REPO/.gpu_model/"; fi
done
EXCL="$(cd "$REPO" && cd "$(git rev-parse --git-common-dir)" && pwd)/info/exclude"
grep -qx '/.gpu_model/' "$EXCL" 2>/dev/null || echo '/.gpu_model/' >>"$EXCL"
grep -qx '/.whl/' "$EXCL" 2>/dev/null || echo '/.whl/' >>"$EXCL"
ls -la "$REPO/.gpu_model"
