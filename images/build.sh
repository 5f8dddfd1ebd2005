#!/usr/bin/env bash
# Builds the project's container images with no registry: a Debian base root file system made by
# mmdebstrap from Debian's own packages, imported into podman, then the engine and operator images from
# docker/*.Dockerfile on top of it. Each image is tagged with a hash of its inputs
# (localhost/<name>:inputs-<hash>); a run that finds every tag does nothing. The chart's appVersion tag
# (localhost/tokenmill/engine:0.1.0, ...) points at the current build.
#
# Usage: images/build.sh            # build what is missing, print the image names
#        images/build.sh --check    # exit 1 if an image is missing, build nothing
#        images/build.sh --names    # print the image names (appVersion tags) and exit
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
SUITE=bookworm  # Debian 12, the suite whose python3 (3.11) the pinned wheels are built for
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
UV_VERSION=0.13.9  # the Makefile's; its cached binary is mounted into the builds
UV_BIN="$CACHE/tools/uv-$UV_VERSION/bin"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"
NICE="nice -n 15"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO/charts/tokenmill-operator/Chart.yaml")"
ENGINE="localhost/tokenmill/engine"
OPERATOR="localhost/tokenmill/operator"
BASE="localhost/tokenmill-base"

log() { printf '[images] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

CHECK_ONLY=false
case "${1:-}" in
    --check) CHECK_ONLY=true ;;
    --names) echo "$ENGINE:$APP_VERSION $OPERATOR:$APP_VERSION"; exit 0 ;;
    "") ;;
    *) die "unknown argument $1 (use --check or --names)" ;;
esac

for tool in podman mmdebstrap; do
    command -v "$tool" >/dev/null || die "$tool is not installed (make image-tools installs Debian's podman, runc, mmdebstrap)"
done

# One build at a time on a machine (several checkouts or CI runs share podman's storage): a concurrent
# `podman image prune` would remove another build's intermediate images.
mkdir -p "$CACHE/images"
exec 9>"$CACHE/images/build.lock"
flock 9

packages() { grep -v '^\s*#' "$HERE/base-packages.txt" | grep -v '^\s*$' | paste -sd, -; }

# A hash over file contents and names (sorted), so a change to any input rebuilds that image only.
hash_files() {
    (cd "$REPO" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z \
        | xargs -0 sha256sum) | sha256sum | cut -c1-16
}

elapsed() { echo $(( $(date +%s) - $1 ))s; }

# Drops the older inputs-* tags of a repository, then the images and layers nothing refers to any more
# (an image a container still runs stays until that container is gone).
prune_old() { # repo keep-tag
    local ref
    for ref in $(podman images --format '{{.Repository}}:{{.Tag}}' "$1" | grep ':inputs-' || true); do
        [[ "$ref" == "$1:$2" ]] || podman untag "$ref" "$ref" >/dev/null 2>&1 || true
    done
    podman image prune -f >/dev/null 2>&1 || true
}

build_base() {
    local hash tag t0 tmp
    hash=$(printf '%s\n' "$SUITE" "$MIRROR" "$(packages)" "minbase-v1" | sha256sum | cut -c1-16)
    tag="inputs-$hash"
    BASE_REF="$BASE:$tag"
    podman image exists "$BASE_REF" && return 0
    $CHECK_ONLY && { log "missing: $BASE_REF"; return 1; }
    t0=$(date +%s)
    log "building the base root file system: mmdebstrap --variant=minbase $SUITE ($(packages))"
    tmp=$(mktemp -d)
    # Documentation and locales are never read in a container; apt lists are fetched again by a build step.
    $NICE mmdebstrap --variant=minbase --include="$(packages)" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$SUITE" "$tmp/rootfs.tar" "$MIRROR" >"$tmp/mmdebstrap.log" 2>&1 \
        || { tail -20 "$tmp/mmdebstrap.log" >&2; rm -rf "$tmp"; die "mmdebstrap failed"; }
    podman import --quiet --change 'CMD ["/bin/bash"]' "$tmp/rootfs.tar" "$BASE_REF" >/dev/null
    rm -rf "$tmp"
    prune_old "$BASE" "$tag"
    log "base $BASE_REF in $(elapsed "$t0")"
}

build_image() { # name Containerfile extra-input...
    local name=$1 file=$2 hash tag t0 log_file
    shift 2
    hash=$( { echo "$BASE_REF" "$UV_VERSION"; hash_files "$file" docker/uv.sh "$@"; } | sha256sum | cut -c1-16)
    tag="inputs-$hash"
    if ! podman image exists "$name:$tag"; then
        $CHECK_ONLY && { log "missing: $name:$tag"; return 1; }
        [[ -x "$UV_BIN/uv" ]] || die "no uv at $UV_BIN (make venv installs it)"
        t0=$(date +%s)
        log_file="$CACHE/images/$(basename "$name").log"
        mkdir -p "$(dirname "$log_file")"
        log "building $name from $file (log: $log_file)"
        # The host's uv and its wheel cache are mounted (not copied into any layer), and its CA bundle for
        # the build steps that reach PyPI or Debian through this machine's egress proxy.
        $NICE podman build --network host --pull=never --layers -f "$REPO/$file" \
            --build-arg BASE="$BASE_REF" --build-arg UV_VERSION="$UV_VERSION" \
            --build-arg SSL_CERT_FILE=/run/host-ca.crt \
            --volume "$UV_BIN:/opt/uv:ro" --volume "$(uv_cache):/root/.cache/uv" \
            --volume /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro \
            --label "dev.tokenmill.inputs=$hash" -t "$name:$tag" "$REPO" >"$log_file" 2>&1 \
            || { tail -30 "$log_file" >&2; die "podman build of $name failed"; }
        log "$name:$tag in $(elapsed "$t0")"
    fi
    podman tag "$name:$tag" "$name:$APP_VERSION"
    prune_old "$name" "$tag"
}

uv_cache() { "$UV_BIN/uv" cache dir 2>/dev/null || echo "$HOME/.cache/uv"; }

build_base
SOURCES=(pyproject.toml README.md engine kernels operator)
build_image "$OPERATOR" docker/operator.Dockerfile "${SOURCES[@]}"
build_image "$ENGINE" docker/engine.Dockerfile "${SOURCES[@]}"
echo "$ENGINE:$APP_VERSION $OPERATOR:$APP_VERSION"
