"""A small OTLP/HTTP receiver on loopback: accepts protobuf trace and metric exports and
keeps them in memory, the way a collector would receive them. The tests and
``kvpush bench`` point the services at it to read back what they recorded."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvpush.otel.files import flat_spans, hex_ids


def answer(handler: BaseHTTPRequestHandler, content_type: str, body: bytes) -> None:
    """Answer the handler's request 200 with ``body``."""
    handler.send_response(200)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        """``host``: the one address it listens on (the benchmark's emulated link puts engines
        on network-namespace hosts, which reach the root namespace at the switch's address)."""
        self._lock = threading.Lock()  # protects spans and metric_names
        self.spans: list[dict] = []
        self.metric_names: set[str] = set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest.FromString(body)
                    spans = list(flat_spans(hex_ids(MessageToDict(request))))
                    with receiver._lock:
                        receiver.spans.extend(spans)
                    reply = ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    request = ExportMetricsServiceRequest.FromString(body)
                    names = {
                        metric.name
                        for rm in request.resource_metrics
                        for sm in rm.scope_metrics
                        for metric in sm.metrics
                    }
                    with receiver._lock:
                        receiver.metric_names |= names
                    reply = ExportMetricsServiceResponse()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                answer(self, "application/x-protobuf", reply.SerializeToString())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.endpoint = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def trace_spans(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, predicate, timeout: float = 20.0):
        """Poll until ``predicate(receiver)`` returns something truthy; return it."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            result = predicate(spans)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.2)
