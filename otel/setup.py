"""Tracer and meter providers for one process.

Spans and metrics go to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (OTLP/HTTP) when it is set;
otherwise spans go to OTLP-JSON lines under the local trace folder (see ``files``).
Metrics are also served for Prometheus: on ``KVPUSH_METRICS_PORT`` (``/metrics`` and
``/health``, ``kvpush.otel.endpoint``) when it is set, or by the caller's own HTTP server
(``prometheus=True``: the gateway's). A vLLM engine core is a process of its own: its
connector serves on ``KVPUSH_METRICS_PORT`` + 1 (``engine_metrics_port``).
Idempotent: the first call in a process wins.
"""

from __future__ import annotations

import logging
import os
import threading

from opentelemetry import metrics, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

from kvpush.otel.files import JsonLinesSpanExporter, default_trace_dir

_lock = threading.Lock()  # protects _configured
_configured: str | None = None


class OsRandomIdGenerator(IdGenerator):
    """Ids from os.urandom. The SDK's default draws from ``random``, which vLLM seeds
    identically in every engine process: spans of different processes collided."""

    def generate_span_id(self) -> int:
        return int.from_bytes(os.urandom(8), "big") or 1

    def generate_trace_id(self) -> int:
        return int.from_bytes(os.urandom(16), "big") or 1


def otlp_endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


METRICS_PORT_ENV = "KVPUSH_METRICS_PORT"


def metrics_port() -> int | None:
    value = os.environ.get(METRICS_PORT_ENV)
    return int(value) if value else None


def engine_metrics_port() -> int | None:
    """Where a worker's engine core (a process of its own) serves its connector's metrics."""
    port = metrics_port()
    return port + 1 if port else None


def configure(service_name: str, port: int | None = -1, prometheus: bool = False) -> None:
    """``port``: serve ``/metrics`` and ``/health`` there (-1: ``KVPUSH_METRICS_PORT``, None: no).
    ``prometheus``: feed prometheus_client's registry for a server of the caller's."""
    global _configured
    with _lock:
        if _configured is not None:
            return
        _configured = service_name
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
        provider = TracerProvider(resource=resource, id_generator=OsRandomIdGenerator())
        readers = []
        if otlp_endpoint():
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=200))
            if os.environ.get("OTEL_METRICS_EXPORTER", "otlp") != "none":
                readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        port = metrics_port() if port == -1 else port
        if port is not None or prometheus:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            readers.append(PrometheusMetricReader())
            if port is not None:
                from kvpush.otel import endpoint

                try:
                    endpoint.serve(port, os.environ.get("KVPUSH_METRICS_HOST", "127.0.0.1"), service_name)
                except OSError as exc:  # the port is taken: the service still serves, unscraped
                    logging.getLogger("kvpush.otel").warning("no /metrics on port %s: %s", port, exc)
        if readers:
            from opentelemetry.sdk.metrics import MeterProvider

            metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
        if not otlp_endpoint():
            # One short line per span: cheap, and nothing is lost when a process is killed.
            provider.add_span_processor(
                SimpleSpanProcessor(JsonLinesSpanExporter(default_trace_dir(), service_name))
            )
        trace.set_tracer_provider(provider)


def shutdown() -> None:
    """Flush what is buffered; call before the process exits."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush(5000)
    meter_provider = metrics.get_meter_provider()
    if hasattr(meter_provider, "force_flush"):
        meter_provider.force_flush(5000)


def tracer():
    return trace.get_tracer("kvpush")
