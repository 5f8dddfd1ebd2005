#!/usr/bin/env bash
# Builds the LeaderWorkerSet controller (sigs.k8s.io/lws) from the Go module proxy and caches it
# outside the repo, keyed by version: $TOKENMILL_CACHE/lws/<version>/{bin/lws-controller,crd/,webhook/}.
# The CRD and the webhook manifest are copied from the same module zip, so the controller, its CRD
# and the webhook paths always come from one release. A second run finds the stamp and does nothing.
# v0.6.2 is used because the proxy here serves its source (v0.10.0's is not served).
#
# Usage: e2e/build_lws.sh            # build if missing, print the cache dir
#        e2e/build_lws.sh --check    # exit 1 if missing, build nothing
set -euo pipefail

LWS_VERSION="${LWS_VERSION:-v0.6.2}"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
DIR="$CACHE/lws/$LWS_VERSION"
# Same lean flags as build_cluster_tools.sh: two compile jobs on the shared 2-core machine.
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0

log() { printf '[build-lws] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v go >/dev/null || die "the Go toolchain is not on PATH (need Go >= 1.24 to build the LWS controller)"
HASH=$(printf '%s\n' "$GOFLAGS" "$LWS_VERSION" "lws-v1" | sha256sum | cut -c1-16)
CRD=crd/leaderworkerset.x-k8s.io_leaderworkersets.yaml
if [[ -f "$DIR/.recipe" && "$(cat "$DIR/.recipe")" == "$HASH" && -x "$DIR/bin/lws-controller" \
      && -f "$DIR/$CRD" && -f "$DIR/webhook/manifests.yaml" ]]; then
    echo "$DIR"; exit 0
fi
[[ "${1:-}" == "--check" ]] && { log "missing: sigs.k8s.io/lws $LWS_VERSION"; exit 1; }

t0=$(date +%s)
log "building sigs.k8s.io/lws/cmd@$LWS_VERSION (the controller manager)"
mkdir -p "$CACHE"
tmp=$(mktemp -d "$CACHE/.build-lws.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Build inside the downloaded module with its own go.mod and go.sum (what upstream's image build
# does). `go install sigs.k8s.io/lws/cmd@version` would also read the proxy's version list for a
# deprecation notice, and this proxy refuses that list (403).
src=$(go mod download -json "sigs.k8s.io/lws@$LWS_VERSION" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
[[ -d "$src" ]] || die "the Go module proxy did not serve sigs.k8s.io/lws@$LWS_VERSION"
(cd "$src" && nice -n 19 go build -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" \
    -o "$tmp/lws-controller" ./cmd) || die "go build of sigs.k8s.io/lws@$LWS_VERSION ./cmd failed"
mkdir -p "$DIR/bin" "$DIR/crd" "$DIR/webhook"
cp "$src/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$DIR/crd/"
cp "$src/config/webhook/manifests.yaml" "$DIR/webhook/"
chmod u+w "$DIR/crd/"* "$DIR/webhook/"*
mv "$tmp/lws-controller" "$DIR/bin/lws-controller"
echo "$HASH" >"$DIR/.recipe"
log "lws-controller built in $(( $(date +%s) - t0 ))s"
echo "$DIR"
