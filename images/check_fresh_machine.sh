#!/usr/bin/env bash
# The fresh-machine path of `make image-tools`, run here without touching this machine's own podman:
# a clean Debian bookworm (mmdebstrap --variant=minbase, plus make and ca-certificates; no podman, runc
# or mmdebstrap) imported as a throwaway image and run privileged with this checkout mounted read-only
# at /repo. Inside it: `make image-tools` (the real apt-get install from Debian), then that podman, with
# nothing configured but the repository's images/containers.conf, runs a container under the restricted
# flags e2e/container_runner.py uses. Not part of `make test` (it downloads ~100 MB of packages; ~5 min).
#
# Usage: images/check_fresh_machine.sh     # as root, with podman and mmdebstrap on this machine
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d /var/tmp/tokenmill-fresh.XXXXXX)"
IMAGE="localhost/tokenmill-fresh-check:$(basename "$WORK")"
export CONTAINERS_CONF="$REPO/images/containers.conf"
trap 'podman rmi -f "$IMAGE" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
t0=$(date +%s)
nice -n 15 mmdebstrap --variant=minbase --include=make,ca-certificates bookworm "$WORK/fresh.tar" \
    http://deb.debian.org/debian 2>"$WORK/mmdebstrap.log" || { tail -20 "$WORK/mmdebstrap.log"; exit 1; }
podman import -q "$WORK/fresh.tar" "$IMAGE" >/dev/null
rm "$WORK/fresh.tar"
echo "[fresh] a clean Debian bookworm in $(( $(date +%s) - t0 ))s"
mkdir -p "$WORK/storage"
# The inner podman keeps its storage on a volume (overlay cannot sit on the outer container's overlay).
podman run --rm --privileged --network=host -v "$REPO:/repo:ro" -v "$WORK/storage:/var/lib/containers" "$IMAGE" \
    bash -c '
set -euo pipefail
for t in podman runc mmdebstrap; do command -v $t >/dev/null || echo "[fresh] before: no $t"; done
[ -e /etc/containers ] || echo "[fresh] before: no /etc/containers"
cd /repo && make image-tools
export CONTAINERS_CONF=/repo/images/containers.conf
tar -C / --exclude=./proc --exclude=./sys --exclude=./dev --exclude=./repo --exclude=./var/lib/containers \
    --exclude=./run --exclude=./tmp -cf /var/lib/containers/root.tar . 2>/dev/null || true
podman import -q /var/lib/containers/root.tar localhost/fresh:1 >/dev/null
echo "[fresh] podman: $(podman info --format "{{.Store.GraphDriverName}} storage, {{.Host.OCIRuntime.Name}}, {{.Host.CgroupManager}}")"
podman run --rm --network=host --user 1000:1000 --read-only --read-only-tmpfs=false --cap-drop ALL \
    --security-opt no-new-privileges localhost/fresh:1 sh -c "echo \"[fresh] in the container: \$(id -u):\$(id -g) \$(grep -E \"CapEff|NoNewPrivs\" /proc/self/status | tr -s \"\t\n\" \" \")\""
'
echo "[fresh] done in $(( $(date +%s) - t0 ))s"
