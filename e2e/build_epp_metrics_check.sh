#!/usr/bin/env bash
# Builds e2e/epp_metrics_check (our own ~60 lines) inside a copy of the endpoint picker's module (19 MB;
# the module cache is read-only and refuses overlays), with the EPP release's go.mod and go.sum, so that
# it scrapes and parses /metrics with the EPP's own code. Cached beside the EPP build:
# $TOKENMILL_CACHE/epp/<version>/bin/metrics-check, keyed by the source's hash.
#
# Usage: e2e/build_epp_metrics_check.sh     # build if missing (and the EPP first), print the binary's path
set -euo pipefail

MODULE=sigs.k8s.io/gateway-api-inference-extension
HERE="$(cd "$(dirname "$0")" && pwd)"
SRC="$HERE/epp_metrics_check/main.go"
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0
export GOWORK=off

log() { printf '[build-epp-metrics-check] %s\n' "$*" >&2; }

dir=$(bash "$HERE/build_epp.sh" | tail -1)  # the EPP's cache folder: its version is the folder's name
version=$(basename "$dir")
stamp=$( (cat "$SRC"; printf '%s\n' "$GOFLAGS" "$version") | sha256sum | cut -c1-16)
bin="$dir/bin/metrics-check"
if [[ -x "$bin" && -f "$dir/.metrics-check" && "$(cat "$dir/.metrics-check")" == "$stamp" ]]; then
    echo "$bin"
    exit 0
fi
src=$(go mod download -json "$MODULE@$version" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
[[ -d "$src" ]] || { log "ERROR: go mod download $MODULE@$version gave no folder"; exit 1; }
t0=$(date +%s)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$src" "$tmp/module"
chmod -R u+w "$tmp/module"
mkdir -p "$tmp/module/cmd/tokenmill-metrics-check"
cp "$SRC" "$tmp/module/cmd/tokenmill-metrics-check/main.go"
(cd "$tmp/module" && nice -n 19 go build -ldflags "-s -w" -o "$tmp/metrics-check" ./cmd/tokenmill-metrics-check) \
    || { log "ERROR: go build of the metrics check in $MODULE@$version failed"; exit 1; }
mv "$tmp/metrics-check" "$bin"
echo "$stamp" >"$dir/.metrics-check"
log "metrics-check for epp $version built in $(( $(date +%s) - t0 ))s"
echo "$bin"
