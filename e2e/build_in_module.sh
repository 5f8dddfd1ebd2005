#!/usr/bin/env bash
# Builds one main.go of ours inside a copy of a Go module from the proxy (its own go.mod and go.sum; the
# module cache is read-only and refuses overlays), so that the program runs that release's own code.
#
# Usage: e2e/build_in_module.sh MODULE VERSION MAIN_GO OUT_BINARY
set -euo pipefail
module=$1 version=$2 main_go=$3 out=$4
export GOFLAGS="-p=2 -trimpath -buildvcs=false" CGO_ENABLED=0 GOWORK=off
log() { printf '[build-in-module] %s\n' "$*" >&2; }
command -v go >/dev/null || { log "ERROR: the Go toolchain is not on PATH"; exit 1; }
src=$(go mod download -json "$module@$version" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p') || true
[[ -d "$src" ]] || { log "ERROR: the Go module proxy did not serve $module@$version"; exit 1; }
t0=$(date +%s)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$src" "$tmp/module"
chmod -R u+w "$tmp/module"
mkdir -p "$tmp/module/cmd/tokenmill-check" "$(dirname "$out")"
cp "$main_go" "$tmp/module/cmd/tokenmill-check/main.go"
(cd "$tmp/module" && nice -n 19 go build -ldflags "-s -w" -o "$tmp/bin" ./cmd/tokenmill-check) \
    || { log "ERROR: go build of $main_go in $module@$version failed"; exit 1; }
mv "$tmp/bin" "$out"
log "$(basename "$out") for $module@$version built in $(( $(date +%s) - t0 ))s"
