"""A process's ``/metrics`` (Prometheus text format), ``/health`` and ``/ready``, on a port
of its own. ``/health``: the process runs. ``/ready``: it serves (a worker once its engine
is up and it heartbeats, a scheduler once it takes requests: ``mark_ready``); 503 before.

The metrics are kvpush's OpenTelemetry instruments (``kvpush.otel.metrics``) read by
OpenTelemetry's Prometheus exporter, so OTLP and Prometheus see the same numbers, named
the Prometheus way (``kvpush_ttft_milliseconds``, ``kvpush_requests_total``). A plain
``http.server`` thread serves them: nothing in the process's event loop can stall a scrape.

    serve(9100)   # what kvpush.otel.setup.configure does when KVPUSH_METRICS_PORT is set
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


READY = threading.Event()


def mark_ready() -> None:
    """The process serves now: ``/ready`` answers 200 from here on."""
    READY.set()


class _Handler(BaseHTTPRequestHandler):
    service = "kvpush"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif path == "/health":
            self._reply(200, json.dumps({"status": "ok", "service": self.service}).encode(), "application/json")
        elif path == "/ready":
            ready = READY.is_set()
            self._reply(200 if ready else 503, json.dumps({"status": "ready" if ready else "starting",
                                                           "service": self.service}).encode(), "application/json")
        else:
            self._reply(404, b'{"error": "only /metrics, /health and /ready are here"}', "application/json")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # scrapes every few seconds: not worth a log line
        pass


def serve(port: int, host: str = "127.0.0.1", service: str = "kvpush") -> ThreadingHTTPServer:
    """Serve ``/metrics``, ``/health`` and ``/ready`` on ``host:port`` (0: a free port) from a daemon thread."""
    handler = type("Handler", (_Handler,), {"service": service})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-endpoint", daemon=True).start()
    return server
