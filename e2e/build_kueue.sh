#!/usr/bin/env bash
# Builds Kueue's controller manager (sigs.k8s.io/kueue/cmd/kueue) from the Go module proxy and caches it
# outside the repo, keyed by version: $TOKENMILL_CACHE/kueue/<version>/{bin/kueue,crd/,webhook/}.
# The CRDs (with the kustomization and patches that give five of them a conversion webhook) and the
# webhook manifest are copied from the same module zip, so the controller, its CRDs and the webhook
# paths always come from one release. A second run finds the stamp and does nothing.
# v0.19.2 is served by the proxy as an exact version (it lists none); v0.17.0 is the other one served
# (KUEUE_VERSION=v0.17.0).
#
# Usage: e2e/build_kueue.sh            # build if missing, print the cache dir
#        e2e/build_kueue.sh --check    # exit 1 if missing, build nothing
set -euo pipefail

KUEUE_VERSION="${KUEUE_VERSION:-v0.19.2}"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
DIR="$CACHE/kueue/$KUEUE_VERSION"
# Same lean flags as build_cluster_tools.sh: two compile jobs on the shared 2-core machine.
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0

log() { printf '[build-kueue] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v go >/dev/null || die "the Go toolchain is not on PATH (need Go >= 1.26 to build Kueue $KUEUE_VERSION)"
HASH=$(printf '%s\n' "$GOFLAGS" "$KUEUE_VERSION" "kueue-v2" | sha256sum | cut -c1-16)
if [[ -f "$DIR/.recipe" && "$(cat "$DIR/.recipe")" == "$HASH" && -x "$DIR/bin/kueue" \
      && -f "$DIR/crd/kueue.x-k8s.io_workloads.yaml" && -f "$DIR/crd/kustomization.yaml" \
      && -f "$DIR/webhook/manifests.yaml" ]]; then
    echo "$DIR"; exit 0
fi
[[ "${1:-}" == "--check" ]] && { log "missing: sigs.k8s.io/kueue $KUEUE_VERSION"; exit 1; }

t0=$(date +%s)
log "building sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION (the controller manager)"
mkdir -p "$CACHE"
tmp=$(mktemp -d "$CACHE/.build-kueue.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Inside the downloaded module with its own go.mod and go.sum, as build_lws.sh does: `go install
# ...@version` would read the proxy's version list, which this proxy refuses (403).
src=$(go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
[[ -d "$src" ]] || die "the Go module proxy did not serve sigs.k8s.io/kueue@$KUEUE_VERSION"
(cd "$src" && nice -n 19 go build -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
    -o "$tmp/kueue" ./cmd/kueue) || die "go build of sigs.k8s.io/kueue@$KUEUE_VERSION ./cmd/kueue failed"
rm -rf "$DIR/crd" "$DIR/webhook"
mkdir -p "$DIR/bin" "$DIR/crd/patches" "$DIR/webhook"
cp "$src"/config/components/crd/bases/*.yaml "$src/config/components/crd/kustomization.yaml" "$DIR/crd/"
cp "$src"/config/components/crd/patches/webhook_in_*.yaml "$DIR/crd/patches/"
cp "$src/config/components/webhook/manifests.yaml" "$DIR/webhook/"
chmod -R u+w "$DIR/crd" "$DIR/webhook"
mv "$tmp/kueue" "$DIR/bin/kueue"
echo "$HASH" >"$DIR/.recipe"
log "kueue built in $(( $(date +%s) - t0 ))s"
echo "$DIR"
