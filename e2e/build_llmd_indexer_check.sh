#!/usr/bin/env bash
# Builds e2e/llmd_indexer_check (our own ~110 lines) inside llm-d's KV-cache indexer module,
# github.com/llm-d/llm-d-kv-cache (pure Go: its ZeroMQ is go-zeromq; e2e/build_in_module.sh), so that the
# events the engine publishes are received, decoded and indexed by llm-d's own code. Cached by version
# and source hash: $TOKENMILL_CACHE/llmd-kv-cache/<version>/bin/indexer-check. The Go module proxy serves
# exact versions only (it refuses version lists here).
#
# Usage: e2e/build_llmd_indexer_check.sh     # build if missing, print the binary's path
set -euo pipefail

VERSION="${LLMD_KV_CACHE_VERSION:-v0.8.1}"
HERE="$(cd "$(dirname "$0")" && pwd)"
SRC="$HERE/llmd_indexer_check/main.go"
dir="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}/llmd-kv-cache/$VERSION"
bin="$dir/bin/indexer-check"
stamp=$( (cat "$SRC" "$HERE/build_in_module.sh"; echo "$VERSION") | sha256sum | cut -c1-16)
if ! [[ -x "$bin" && -f "$dir/.recipe" && "$(cat "$dir/.recipe")" == "$stamp" ]]; then
    bash "$HERE/build_in_module.sh" github.com/llm-d/llm-d-kv-cache "$VERSION" "$SRC" "$bin"
    echo "$stamp" >"$dir/.recipe"
fi
echo "$bin"
