#!/usr/bin/env bash
# A release's publishing step: pushes the images `make images` built for this checkout
# (localhost/tokenmill/{operator,engine}:<appVersion>) to REGISTRY/{operator,engine}:<appVersion>, writes
# each pushed manifest's digest, and prints the helm flags that pin both images by digest.
#
# Usage: images/publish.sh REGISTRY [podman push flags...]     e.g. images/publish.sh ghcr.io/tokenmill
#        IMAGES=operator images/publish.sh ...                  # only some of them
# Log in first (`podman login REGISTRY`; in CI with the registry's token). Digests go to $DIGESTS_DIR
# (default: a new folder under /tmp), one file per image.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"
REGISTRY="${1:?usage: images/publish.sh REGISTRY [podman push flags...] (e.g. ghcr.io/tokenmill)}"
shift
IMAGES="${IMAGES:-operator engine}"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO/charts/tokenmill-operator/Chart.yaml")"
DIGESTS_DIR="${DIGESTS_DIR:-$(mktemp -d /tmp/tokenmill-digests.XXXXXX)}"

log() { printf '[publish] %s\n' "$*" >&2; }
# The images must be this checkout's build (their inputs-<hash> tags), not an older one under the same tag.
bash "$HERE/build.sh" --check >/dev/null || { log "ERROR: the images of this checkout are not built: make images"; exit 1; }

flags=()
for name in $IMAGES; do
    src="localhost/tokenmill/$name:$APP_VERSION"
    dst="$REGISTRY/$name:$APP_VERSION"
    log "pushing $src -> $dst"
    podman push --quiet "$@" --digestfile "$DIGESTS_DIR/$name.digest" "$src" "docker://$dst"
    digest="$(cat "$DIGESTS_DIR/$name.digest")"
    log "$dst@$digest"
    key=$([ "$name" = operator ] && echo image || echo engineImage)
    flags+=(--set "$key.repository=$REGISTRY/$name" --set "$key.tag=$APP_VERSION@$digest")
done
echo "${flags[@]}"
