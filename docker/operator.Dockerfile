# The operator image: `tokenmill operator` (Kopf). No torch: the sizing math is dependency-free. No compiler.
# `make images` builds it on a Debian base made by mmdebstrap (images/build.sh, BASE=localhost/tokenmill-base:<hash>);
# elsewhere:  docker build -f docker/operator.Dockerfile -t tokenmill/operator:0.1.0 .
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG UV_VERSION=0.13.9
# SSL_CERT_FILE: a CA bundle for an egress proxy, when the build machine needs one (make images passes
# the host's); unset, uv trusts its own roots.
ARG SSL_CERT_FILE

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tokenmill/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp

# docker/uv.sh: where uv comes from (the build machine's cached one, else PyPI) and its cache.
COPY docker/uv.sh /usr/local/lib/tokenmill-uv.sh
COPY pyproject.toml /src/
RUN . /usr/local/lib/tokenmill-uv.sh \
    && "$UV" venv -q --python python3 /opt/tokenmill \
    && "$UV" pip install -q --python /opt/tokenmill/bin/python -r /src/pyproject.toml --extra operator \
    && rm -rf /tmp/uv
COPY README.md /src/
COPY engine /src/engine
COPY kernels /src/kernels
COPY operator /src/operator
RUN . /usr/local/lib/tokenmill-uv.sh \
    && "$UV" pip install -q --python /opt/tokenmill/bin/python --no-deps /src \
    && rm -rf /src /tmp/uv /tmp/* /usr/local/lib/tokenmill-uv.sh \
    && tokenmill --version \
    && ! command -v cc && ! command -v gcc

# Matches the chart's securityContext (runAsNonRoot, runAsUser 65532). The pod mounts /tmp (HOME) as
# its one writable place, so the root file system can be read-only.
USER 65532:65532
WORKDIR /tmp

ENTRYPOINT ["tokenmill"]
CMD ["operator"]
