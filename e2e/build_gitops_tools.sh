#!/usr/bin/env bash
# Builds the two small Go checks of the GitOps e2e tests from the Go module proxy and caches them
# outside the repo, keyed by the library version (as e2e/build_cluster_tools.sh does):
#   lua-health  e2e/tools/luahealth  github.com/yuin/gopher-lua  (the Lua VM Argo CD embeds)
#               -> $TOKENMILL_CACHE/gopher-lua/<version>/bin/lua-health
#   kstatus     e2e/tools/kstatus    sigs.k8s.io/cli-utils       (kstatus: Flux's and kpt's health)
#               -> $TOKENMILL_CACHE/cli-utils/<version>/bin/kstatus
# A second run finds both binaries and their recipe stamps and does nothing.
#
# Usage: e2e/build_gitops_tools.sh            # build what is missing, print the bin dirs
#        e2e/build_gitops_tools.sh --check    # exit 1 if anything is missing, build nothing
set -euo pipefail

GOPHER_LUA_VERSION="${GOPHER_LUA_VERSION:-v1.1.2}"
CLI_UTILS_VERSION="${CLI_UTILS_VERSION:-v0.37.2}"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
HERE="$(cd "$(dirname "$0")" && pwd)"
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0

log() { printf '[build-gitops-tools] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

build() { # binary source-dir module version
    local name=$1 src_dir=$2 module=$3 version=$4 dir hash src t0
    dir="$CACHE/${module##*/}/$version"
    hash=$(printf '%s\n' "$GOFLAGS" "$module" "$version" "$(cat "$HERE/tools/$src_dir/main.go")" | sha256sum | cut -c1-16)
    [[ -f "$dir/.recipe" && "$(cat "$dir/.recipe")" == "$hash" && -x "$dir/bin/$name" ]] && return 0
    $CHECK_ONLY && { log "missing: $name ($module $version)"; return 1; }
    t0=$(date +%s)
    log "building $name against $module $version"
    src="$dir/src"
    rm -rf "$src" && mkdir -p "$src" "$dir/bin"
    cp "$HERE/tools/$src_dir/main.go" "$src/main.go"
    printf 'module tokenmill.local/e2e/%s\n\ngo 1.25.0\n\nrequire %s %s\n' "$name" "$module" "$version" >"$src/go.mod"
    (cd "$src" && nice -n 19 go mod tidy) || die "go mod tidy failed for $module $version"
    grep -q "^require $module $version\$\|	$module $version\$" "$src/go.mod" \
        || die "go mod tidy moved $module off $version (see $src/go.mod)"
    (cd "$src" && nice -n 19 go build -ldflags "-s -w" -o "$dir/bin/$name.tmp" .) || die "go build of $name failed"
    mv "$dir/bin/$name.tmp" "$dir/bin/$name"
    echo "$hash" >"$dir/.recipe"
    log "$name built in $(( $(date +%s) - t0 ))s"
}

CHECK_ONLY=false
[[ "${1:-}" == "--check" ]] && CHECK_ONLY=true
command -v go >/dev/null || die "the Go toolchain is not on PATH"
mkdir -p "$CACHE"
status=0
build lua-health luahealth github.com/yuin/gopher-lua "$GOPHER_LUA_VERSION" || status=1
build kstatus kstatus sigs.k8s.io/cli-utils "$CLI_UTILS_VERSION" || status=1
echo "$CACHE/gopher-lua/$GOPHER_LUA_VERSION/bin:$CACHE/cli-utils/$CLI_UTILS_VERSION/bin"
exit $status
