#!/usr/bin/env bash
# Builds the Gateway API Inference Extension's endpoint picker (EPP,
# sigs.k8s.io/gateway-api-inference-extension/cmd/epp) from the Go module proxy and caches it outside
# the repo, keyed by version: $TOKENMILL_CACHE/epp/<version>/{bin/epp,crd/}. The InferencePool CRD (and
# the optional InferenceObjective / InferenceModelRewrite ones) are copied from the same module zip, so
# the picker and the CRDs it watches come from one release. A second run finds the stamp and does nothing.
# v1.5.0 is the release the project targets; when the proxy does not serve it (and EPP_VERSION was not
# set), v1.3.0 is built instead.
#
# Usage: e2e/build_epp.sh            # build if missing, print the cache dir
#        e2e/build_epp.sh --check    # exit 1 if missing, build nothing
set -euo pipefail

MODULE=sigs.k8s.io/gateway-api-inference-extension
FALLBACK_VERSION=v1.3.0
EPP_VERSION="${EPP_VERSION:-}"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
# Same lean flags as build_cluster_tools.sh: two compile jobs on the shared 2-core machine.
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0
# The module zip has a go.work naming ./conformance, which the zip does not hold.
export GOWORK=off
CRDS=(inference.networking.k8s.io_inferencepools.yaml inference.networking.x-k8s.io_inferenceobjectives.yaml
      inference.networking.x-k8s.io_inferencemodelrewrites.yaml)

log() { printf '[build-epp] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

recipe() { printf '%s\n' "$GOFLAGS" "$1" "epp-v1" | sha256sum | cut -c1-16; }
cached() {  # cached VERSION: the stamp, the binary and every CRD are there
    local dir="$CACHE/epp/$1" f
    [[ -f "$dir/.recipe" && "$(cat "$dir/.recipe")" == "$(recipe "$1")" && -x "$dir/bin/epp" ]] || return 1
    for f in "${CRDS[@]}"; do [[ -f "$dir/crd/$f" ]] || return 1; done
}

candidates=("${EPP_VERSION:-v1.5.0}")
[[ -z "$EPP_VERSION" ]] && candidates+=("$FALLBACK_VERSION")
for v in "${candidates[@]}"; do
    if cached "$v"; then echo "$CACHE/epp/$v"; exit 0; fi
done
[[ "${1:-}" == "--check" ]] && { log "missing: $MODULE/cmd/epp ${candidates[0]}"; exit 1; }
command -v go >/dev/null || die "the Go toolchain is not on PATH (need Go >= 1.25 to build the EPP)"

t0=$(date +%s)
src=""
for v in "${candidates[@]}"; do
    # Build inside the downloaded module with its own go.mod and go.sum (what upstream's Dockerfile
    # does); `go install ...@version` would also ask the proxy for its version list, which it refuses.
    src=$(go mod download -json "$MODULE@$v" 2>/dev/null | sed -n 's/.*"Dir": "\(.*\)",*/\1/p') || true
    if [[ -d "$src" ]]; then VERSION=$v; break; fi
    log "the Go module proxy did not serve $MODULE@$v"
done
[[ -d "$src" ]] || die "no EPP version could be downloaded (tried ${candidates[*]})"
DIR="$CACHE/epp/$VERSION"
log "building $MODULE/cmd/epp@$VERSION"
mkdir -p "$CACHE"
tmp=$(mktemp -d "$CACHE/.build-epp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(cd "$src" && nice -n 19 go build -ldflags "-s -w -X $MODULE/version.BuildRef=$VERSION" \
    -o "$tmp/epp" ./cmd/epp) || die "go build of $MODULE@$VERSION ./cmd/epp failed"
mkdir -p "$DIR/bin" "$DIR/crd"
for f in "${CRDS[@]}"; do cp "$src/config/crd/bases/$f" "$DIR/crd/"; done
chmod u+w "$DIR/crd/"*
mv "$tmp/epp" "$DIR/bin/epp"
recipe "$VERSION" >"$DIR/.recipe"
log "epp $VERSION built in $(( $(date +%s) - t0 ))s"
echo "$DIR"
