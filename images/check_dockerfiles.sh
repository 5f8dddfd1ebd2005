#!/usr/bin/env bash
# Checks that docker/*.Dockerfile stay buildable by `docker build` (BuildKit) and not only by podman:
# runs BuildKit's own Dockerfile frontend over them (images/dockerfile_check: the lint rules of
# `docker build --check`, then the conversion to LLB), once with the default BASE (python:3.11-slim-bookworm,
# what a build elsewhere uses) and once with the mmdebstrap base images/build.sh passes. No daemon, no
# registry. The checker is built from the Go module proxy and cached like the e2e's Go tools:
#   $TOKENMILL_CACHE/buildkit/<version>/bin/dockerfile-check   (a second run only runs it, < 1 s)
#
# Usage: images/check_dockerfiles.sh [FILE...]   # default: docker/*.Dockerfile
set -euo pipefail

BUILDKIT_VERSION="${BUILDKIT_VERSION:-v0.23.2}"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0
DIR="$CACHE/buildkit/$BUILDKIT_VERSION"
BIN="$DIR/bin/dockerfile-check"

log() { printf '[dockerfile-check] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

hash=$(printf '%s\n' "$GOFLAGS" "$BUILDKIT_VERSION" "$(cat "$HERE/dockerfile_check/main.go")" | sha256sum | cut -c1-16)
if ! [[ -f "$DIR/.recipe" && "$(cat "$DIR/.recipe")" == "$hash" && -x "$BIN" ]]; then
    command -v go >/dev/null || die "the Go toolchain is not on PATH"
    t0=$(date +%s)
    log "building dockerfile-check against github.com/moby/buildkit $BUILDKIT_VERSION"
    src="$DIR/src"
    rm -rf "$src" && mkdir -p "$src" "$DIR/bin"
    cp "$HERE/dockerfile_check/main.go" "$src/main.go"
    printf 'module tokenmill.local/images/dockerfile-check\n\ngo 1.24\n\nrequire github.com/moby/buildkit %s\n' \
        "$BUILDKIT_VERSION" >"$src/go.mod"
    (cd "$src" && nice -n 19 go mod tidy) || die "go mod tidy failed"
    grep -q "github.com/moby/buildkit $BUILDKIT_VERSION\$" "$src/go.mod" \
        || die "go mod tidy moved buildkit off $BUILDKIT_VERSION (see $src/go.mod)"
    (cd "$src" && nice -n 19 go build -ldflags "-s -w" -o "$BIN.tmp" .) || die "go build failed"
    mv "$BIN.tmp" "$BIN"
    echo "$hash" >"$DIR/.recipe"
    log "built in $(( $(date +%s) - t0 ))s"
fi

files=("$@")
[ ${#files[@]} -gt 0 ] || files=("$REPO"/docker/*.Dockerfile)
# The same base reference images/build.sh passes (its tag is a hash; the checker needs only its shape).
"$BIN" "${files[@]}" BASE=localhost/tokenmill-base:inputs-0000000000000000 "${files[@]}"
