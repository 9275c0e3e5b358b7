"""Tracer and meter providers for one process.

Spans and metrics go to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (OTLP/HTTP) when it is set;
otherwise spans go to OTLP-JSON lines under the local trace folder (see ``files``) and
metrics are kept in-process only. Idempotent: the first call in a process wins.
"""

from __future__ import annotations

import os
import threading

from opentelemetry import metrics, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

from otel.files import JsonLinesSpanExporter, default_trace_dir

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


def configure(service_name: str) -> None:
    global _configured
    with _lock:
        if _configured is not None:
            return
        _configured = service_name
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
        provider = TracerProvider(resource=resource, id_generator=OsRandomIdGenerator())
        if otlp_endpoint():
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=200))
            if os.environ.get("OTEL_METRICS_EXPORTER", "otlp") != "none":
                reader = PeriodicExportingMetricReader(OTLPMetricExporter())
                metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))
        else:
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
