#!/usr/bin/env bash
# Builds the e2e control plane's binaries from the Go module proxy and caches them outside the repo,
# keyed by version: $TOKENMILL_CACHE/{k8s,etcd,kwok,helm}/<version>/bin/. A second run finds every
# binary and its recipe stamp and does nothing. No package anywhere ships kube-apiserver, so this is
# the only way to get a real one here (see docs/e2e.md).
#
# Usage: e2e/build_cluster_tools.sh            # build what is missing, print the bin dirs
#        e2e/build_cluster_tools.sh --check    # exit 1 if anything is missing, build nothing
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.35.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
HERE="$(cd "$(dirname "$0")" && pwd)"

# Lean build: two compile jobs (the machine has 2 cores and is shared), no DWARF/symbol tables
# (faster links, smaller files), no local paths or VCS stamping in the binaries.
export GOFLAGS="-p=2 -trimpath -buildvcs=false"
export CGO_ENABLED=0
NICE="nice -n 19"

# Staging modules of k8s.io/kubernetes 1.33-1.35: each must be replaced by its v0.x.y twin.
K8S_STAGING="api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api cri-client
csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator
kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics mount-utils
pod-security-admission sample-apiserver sample-cli-plugin sample-controller"

log() { printf '[build-cluster-tools] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# The stamp holds a hash of everything that decides a build (sources, versions, flags), so changing
# the recipe rebuilds that tool and nothing else.
recipe_hash() { printf '%s\n' "$GOFLAGS" "$@" | sha256sum | cut -c1-16; }

is_built() { # dir stamp-hash binaries...
    local dir=$1 hash=$2; shift 2
    [[ -f "$dir/.recipe" && "$(cat "$dir/.recipe")" == "$hash" ]] || return 1
    for b in "$@"; do [[ -x "$dir/bin/$b" ]] || return 1; done
}

elapsed() { echo $(( $(date +%s) - $1 ))s; }

build_kube() {
    local dir="$CACHE/k8s/$K8S_VERSION" minor hash src staging_ver
    hash=$(recipe_hash "$(cat "$HERE/tools/kube/main.go")" "$K8S_STAGING" "ld-v1")
    is_built "$dir" "$hash" kube kube-apiserver kube-controller-manager kube-scheduler kubectl && return 0
    $CHECK_ONLY && { log "missing: kube components $K8S_VERSION"; return 1; }
    local t0; t0=$(date +%s)
    log "building kube-apiserver/controller-manager/scheduler/kubectl $K8S_VERSION (one multi-call binary)"
    minor=$(cut -d. -f2 <<<"$K8S_VERSION")
    staging_ver="v0.${K8S_VERSION#v1.}"
    src="$dir/src"
    rm -rf "$src" && mkdir -p "$src" "$dir/bin"
    cp "$HERE/tools/kube/main.go" "$src/main.go"
    {
        echo "module tokenmill.local/e2e/kube"
        echo
        echo "go 1.25.0"
        echo
        # Upstream k8s.io/kubernetes 1.35 builds with this godebug default; keep its behaviour.
        echo "godebug default=go1.25"
        echo
        echo "require k8s.io/kubernetes $K8S_VERSION"
        echo
        echo "replace ("
        for m in $K8S_STAGING; do echo "	k8s.io/$m => k8s.io/$m $staging_ver"; done
        echo ")"
    } >"$src/go.mod"
    (cd "$src" && $NICE go mod tidy) || die "go mod tidy failed for k8s.io/kubernetes $K8S_VERSION"
    local pkgs=(k8s.io/component-base/version k8s.io/client-go/pkg/version)
    local ld="-s -w"
    for p in "${pkgs[@]}"; do
        ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
        ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    (cd "$src" && $NICE go build -ldflags "$ld" -o "$dir/bin/kube.tmp" .) \
        || die "go build of the kube components failed (see above)"
    mv "$dir/bin/kube.tmp" "$dir/bin/kube"
    for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
        ln -sfn kube "$dir/bin/$name"
    done
    echo "$hash" >"$dir/.recipe"
    log "kube components built in $(elapsed "$t0")"
}

build_etcd() {
    local dir="$CACHE/etcd/$ETCD_VERSION" hash src
    hash=$(recipe_hash "$(cat "$HERE/tools/etcd/main.go")")
    is_built "$dir" "$hash" etcd && return 0
    $CHECK_ONLY && { log "missing: etcd $ETCD_VERSION"; return 1; }
    local t0; t0=$(date +%s)
    log "building etcd $ETCD_VERSION"
    src="$dir/src"
    rm -rf "$src" && mkdir -p "$src" "$dir/bin"
    cp "$HERE/tools/etcd/main.go" "$src/main.go"
    # etcd's sibling modules are released in lockstep; pin them all to the same tag.
    cat >"$src/go.mod" <<EOF
module tokenmill.local/e2e/etcd

go 1.25.0

require (
	go.etcd.io/etcd/server/v3 $ETCD_VERSION
	go.etcd.io/etcd/api/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/pkg/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/v3 $ETCD_VERSION
	go.etcd.io/etcd/pkg/v3 $ETCD_VERSION
)
EOF
    (cd "$src" && $NICE go mod tidy) || die "go mod tidy failed for etcd $ETCD_VERSION"
    (cd "$src" && $NICE go build -ldflags "-s -w" -o "$dir/bin/etcd.tmp" .) || die "go build of etcd failed"
    mv "$dir/bin/etcd.tmp" "$dir/bin/etcd"
    echo "$hash" >"$dir/.recipe"
    log "etcd built in $(elapsed "$t0")"
}

go_install() { # name module-path@version dir recipe-key ldflags-function
    local name=$1 target=$2 dir=$3 key=$4 ldfn=$5 hash ld
    hash=$(recipe_hash "$target" "$key")
    is_built "$dir" "$hash" "$name" && return 0
    $CHECK_ONLY && { log "missing: $target"; return 1; }
    local t0; t0=$(date +%s)
    log "building $target"
    ld=$($ldfn) || die "cannot work out the link flags for $target"
    # go install in module mode: the tool's own go.mod decides its dependencies. Install into a
    # temporary folder so a failed build leaves no half-made cache entry.
    local tmp; tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
    if ! GOBIN="$tmp" $NICE go install -ldflags "$ld" "$target"; then
        rm -rf "$tmp"; die "go install $target failed (is $target served by the Go module proxy?)"
    fi
    mkdir -p "$dir/bin" && mv "$tmp/$name" "$dir/bin/$name" && rm -rf "$tmp"
    echo "$hash" >"$dir/.recipe"
    log "$name built in $(elapsed "$t0")"
}

kwok_ldflags() { echo "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"; }

# Helm's default Kubernetes version (for `helm template` and lint) is stamped from the client-go it
# builds with, as its own Makefile does; unstamped it is v1.20 and fails charts' kubeVersion checks.
helm_ldflags() {
    local mod minor ld
    mod=$(go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
    minor=$(sed -n 's/^[[:space:]]*k8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$mod" | head -1)
    [[ -n "$minor" ]] || { log "no k8s.io/client-go requirement in helm $HELM_VERSION's go.mod ($mod)"; return 1; }
    ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
    ld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
        ld+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$minor"
    done
    echo "$ld"
}

CHECK_ONLY=false
[[ "${1:-}" == "--check" ]] && CHECK_ONLY=true
command -v go >/dev/null || die "the Go toolchain is not on PATH (need Go >= 1.25 to build kube-apiserver)"

mkdir -p "$CACHE"
T0=$(date +%s)
status=0
build_kube || status=1
build_etcd || status=1
go_install kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "$CACHE/kwok/$KWOK_VERSION" "$(kwok_ldflags)" kwok_ldflags \
    || status=1
# The key names the recipe (the flags depend on helm's go.mod, read only when building).
go_install helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" "$CACHE/helm/$HELM_VERSION" "ld-v2" helm_ldflags || status=1
$CHECK_ONLY || log "all tools ready in $(elapsed "$T0")"
echo "$CACHE/k8s/$K8S_VERSION/bin:$CACHE/etcd/$ETCD_VERSION/bin:$CACHE/kwok/$KWOK_VERSION/bin:$CACHE/helm/$HELM_VERSION/bin"
exit $status
