#!/usr/bin/env bash
# Builds e2e/epp_metrics_check (our own ~60 lines) inside the endpoint picker's module
# (e2e/build_in_module.sh), so that it scrapes and parses /metrics with the EPP release's own code. Cached
# beside the EPP build: $TOKENMILL_CACHE/epp/<version>/bin/metrics-check, keyed by the source's hash.
#
# Usage: e2e/build_epp_metrics_check.sh     # build if missing (and the EPP first), print the binary's path
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
SRC="$HERE/epp_metrics_check/main.go"

dir=$(bash "$HERE/build_epp.sh" | tail -1)  # the EPP's cache folder: its version is the folder's name
version=$(basename "$dir")
stamp=$( (cat "$SRC" "$HERE/build_in_module.sh"; echo "$version") | sha256sum | cut -c1-16)
bin="$dir/bin/metrics-check"
if ! [[ -x "$bin" && -f "$dir/.metrics-check" && "$(cat "$dir/.metrics-check")" == "$stamp" ]]; then
    bash "$HERE/build_in_module.sh" sigs.k8s.io/gateway-api-inference-extension "$version" "$SRC" "$bin"
    echo "$stamp" >"$dir/.metrics-check"
fi
echo "$bin"
