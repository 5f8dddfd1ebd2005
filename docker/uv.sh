# Sourced by the Containerfiles' install steps: sets UV to a uv binary and the environment it runs with.
# `make images` mounts its cached uv at /opt/uv/uv and this machine's uv cache at /root/.cache/uv, so
# wheels are copied from the cache instead of downloaded; elsewhere (docker build) uv's wheel comes from
# PyPI into /tmp/uv, removed by the same step.
set -e
[ -n "${SSL_CERT_FILE:-}" ] || unset SSL_CERT_FILE
# Bytecode compiled at build time: the root file system is read-only at run time, so without it every
# start compiles torch's and transformers' sources again (minutes here).
export UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1 UV_COMPILE_BYTECODE=1
# The mounted cache, else none (a cache written inside the image would stay in its layer).
if [ -d /root/.cache/uv ]; then export UV_CACHE_DIR=/root/.cache/uv; else export UV_NO_CACHE=1; fi
UV=/opt/uv/uv
if [ ! -x "$UV" ]; then
    # uv's wheel from PyPI with Python's standard library only (Debian's python3 has no ensurepip, so no
    # venv with pip, without python3-venv), checked against the sha256 PyPI lists for it; its one binary
    # is all that is kept.
    mkdir -p /tmp/uv
    python3 - "${UV_VERSION:?}" <<'PY'
import hashlib, io, json, platform, sys, urllib.request, zipfile
version = sys.argv[1]
# The simple index in its JSON form (PEP 691), what pip and uv read (PyPI's /pypi/uv/<v>/json API is not
# reachable through every PyPI proxy: this machine's answers 404).
req = urllib.request.Request("https://pypi.org/simple/uv/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
arch = {"x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[platform.machine()]
wheel = next(f for f in files if f["filename"].startswith(f"uv-{version}-") and "manylinux" in f["filename"]
             and f["filename"].endswith(f"_{arch}.whl"))
data = urllib.request.urlopen(wheel["url"], timeout=300).read()
if hashlib.sha256(data).hexdigest() != wheel["hashes"]["sha256"]:
    sys.exit(f"{wheel['filename']}: sha256 differs from PyPI's")
with zipfile.ZipFile(io.BytesIO(data)) as z, open("/tmp/uv/uv", "wb") as out:
    out.write(z.read(f"uv-{version}.data/scripts/uv"))
PY
    chmod 755 /tmp/uv/uv
    UV=/tmp/uv/uv
fi
