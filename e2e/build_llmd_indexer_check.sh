#!/usr/bin/env bash
# Builds e2e/llmd_indexer_check (our own ~90 lines) inside a copy of llm-d's KV-cache indexer module,
# github.com/llm-d/llm-d-kv-cache (pure Go: its ZeroMQ is go-zeromq), with that release's go.mod and go.sum,
# so that the events the engine publishes are received, decoded and indexed by llm-d's own code.
# Cached by version and source hash: $TOKENMILL_CACHE/llmd-kv-cache/<version>/bin/indexer-check.
# The Go module proxy serves exact versions only (it refuses version lists here).
#
# Usage: e2e/build_llmd_indexer_check.sh     # build if missing, print the binary's path
set -euo pipefail

MODULE=github.com/llm-d/llm-d-kv-cache
VERSION="${LLMD_KV_CACHE_VERSION:-v0.8.1}"
HERE="$(cd "$(dirname "$0")" && pwd)"
SRC="$HERE/llmd_indexer_check/main.go"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0
export GOWORK=off

log() { printf '[build-llmd-indexer-check] %s\n' "$*" >&2; }

dir="$CACHE/llmd-kv-cache/$VERSION"
bin="$dir/bin/indexer-check"
stamp=$( (cat "$SRC"; printf '%s\n' "$GOFLAGS" "$VERSION") | sha256sum | cut -c1-16)
if [[ -x "$bin" && -f "$dir/.recipe" && "$(cat "$dir/.recipe")" == "$stamp" ]]; then
    echo "$bin"
    exit 0
fi
command -v go >/dev/null || { log "ERROR: the Go toolchain is not on PATH"; exit 1; }
src=$(go mod download -json "$MODULE@$VERSION" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p') || true
[[ -d "$src" ]] || { log "ERROR: the Go module proxy did not serve $MODULE@$VERSION"; exit 1; }
t0=$(date +%s)
mkdir -p "$dir/bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$src" "$tmp/module"
chmod -R u+w "$tmp/module"
mkdir -p "$tmp/module/cmd/tokenmill-indexer-check"
cp "$SRC" "$tmp/module/cmd/tokenmill-indexer-check/main.go"
(cd "$tmp/module" && nice -n 19 go build -ldflags "-s -w" -o "$tmp/indexer-check" ./cmd/tokenmill-indexer-check) \
    || { log "ERROR: go build of the indexer check in $MODULE@$VERSION failed"; exit 1; }
mv "$tmp/indexer-check" "$bin"
echo "$stamp" >"$dir/.recipe"
log "indexer-check for llm-d-kv-cache $VERSION built in $(( $(date +%s) - t0 ))s"
echo "$bin"
