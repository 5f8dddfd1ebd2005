# The operator image: `tokenmill operator` (Kopf). No torch: the sizing math is dependency-free.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t tokenmill/operator:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY operator operator
RUN pip install ".[operator]" && rm -rf /src

# Matches the chart's securityContext (runAsNonRoot, runAsUser 65532).
RUN useradd --uid 65532 --user-group --no-create-home tokenmill
USER 65532:65532
WORKDIR /

ENTRYPOINT ["tokenmill"]
CMD ["operator"]
