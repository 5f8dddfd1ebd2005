# Sourced by the Containerfiles' install steps: sets UV to a uv binary and the environment it runs with.
# `make images` mounts its cached uv at /opt/uv/uv and this machine's uv cache at /root/.cache/uv, so
# wheels are copied from the cache instead of downloaded; elsewhere (docker build) uv comes from PyPI
# into a throwaway venv under /tmp/uv, removed by the same step.
set -e
[ -n "${SSL_CERT_FILE:-}" ] || unset SSL_CERT_FILE
# Bytecode compiled at build time: the root file system is read-only at run time, so without it every
# start compiles torch's and transformers' sources again (minutes here).
export UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1 UV_COMPILE_BYTECODE=1
# The mounted cache, else none (a cache written inside the image would stay in its layer).
if [ -d /root/.cache/uv ]; then export UV_CACHE_DIR=/root/.cache/uv; else export UV_NO_CACHE=1; fi
UV=/opt/uv/uv
if [ ! -x "$UV" ]; then
    python3 -m venv /tmp/uv && /tmp/uv/bin/pip install -q "uv==${UV_VERSION:?}"
    UV=/tmp/uv/bin/uv
fi
