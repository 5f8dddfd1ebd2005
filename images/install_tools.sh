#!/usr/bin/env bash
# `make image-tools`: installs Debian's podman, runc and mmdebstrap (what images/build.sh and the e2e's
# container mode run) with apt-get when one of them is missing, and says so. Nothing else is configured
# on the machine: podman reads images/containers.conf through CONTAINERS_CONF, its storage and policy
# defaults come with the packages (/usr/share/containers/storage.conf, /etc/containers/policy.json).
#
# Usage: images/install_tools.sh              # install what is missing (as root, like CI)
#        images/install_tools.sh --simulate   # say what is missing and run `apt-get install --simulate`
set -euo pipefail

TOOLS=(podman runc mmdebstrap)
# uidmap: newuidmap/newgidmap, which podman needs when it runs rootless (CI runs it as root).
PACKAGES=(podman runc mmdebstrap uidmap)

SIMULATE=false
case "${1:-}" in
    --simulate) SIMULATE=true ;;
    "") ;;
    *) echo "[image-tools] unknown argument $1 (use --simulate)" >&2; exit 2 ;;
esac

missing=()
for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "[image-tools] not found: ${missing[*]}; installing Debian's ${PACKAGES[*]} with apt-get"
if $SIMULATE; then
    exec apt-get install --simulate -q --no-install-recommends "${PACKAGES[@]}"
fi
command -v apt-get >/dev/null || {
    echo "[image-tools] ERROR: no apt-get here; install ${PACKAGES[*]} with this system's package manager" >&2
    exit 1
}
[ "$(id -u)" = 0 ] || {
    echo "[image-tools] ERROR: apt-get needs root; run: sudo apt-get install ${PACKAGES[*]}" >&2
    exit 1
}
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null || { echo "[image-tools] ERROR: $tool still missing after apt-get" >&2; exit 1; }
done
echo "[image-tools] installed: $(podman --version), $(runc --version | head -1), mmdebstrap $(mmdebstrap --version | awk '{print $2}')"
