# The compose check's stand-in for Jaeger (no registry here): the project's own OTLP/HTTP
# receiver (tools/otlp_receiver.py) on 4318, where compose.yaml's services export, and
# GET /spans on 16686, every span it received as JSON (tools/compose_check/otlp_sink.py).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
WORKDIR /app
COPY constraints.txt ./
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-index --find-links /wheels -c constraints.txt \
        opentelemetry-sdk opentelemetry-exporter-otlp-proto-common opentelemetry-proto protobuf
# laid out as the kvpush package installs them (kvpush.otel is otel/, ...), just these files
COPY kvpush/__init__.py ./kvpush/
COPY otel/__init__.py otel/files.py ./kvpush/otel/
COPY tools/__init__.py tools/otlp_receiver.py ./kvpush/tools/
COPY tools/compose_check/__init__.py tools/compose_check/otlp_sink.py ./kvpush/tools/compose_check/
EXPOSE 4318 16686
CMD ["/opt/venv/bin/python", "-m", "kvpush.tools.compose_check.otlp_sink"]
