"""The OTLP receiver the compose check runs in place of Jaeger, in its own container:
the project's receiver (``kvpush.tools.otlp_receiver``) taking OTLP/HTTP on 0.0.0.0:4318, where
compose.yaml's services export, and ``GET /spans`` on 0.0.0.0:16686 answering every span
it has received as a JSON list (``kvpush.otel.files.flat_spans`` dicts).

    python -m kvpush.tools.compose_check.otlp_sink
"""

from __future__ import annotations

import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvpush.tools.otlp_receiver import OtlpReceiver, answer

OTLP_PORT = 4318  # Jaeger's OTLP/HTTP port, where compose.yaml points the services
SPANS_PORT = 16686  # Jaeger's UI port, published by compose.yaml


def serve(otlp_port: int = OTLP_PORT, spans_port: int = SPANS_PORT, host: str = "0.0.0.0"):
    """Start both servers in daemon threads; return them (OTLP first)."""
    receiver = OtlpReceiver()
    # OtlpReceiver binds a free loopback port; a container needs a fixed port on every
    # interface. Same handler (the receiver's), another socket.
    handler = receiver.server.RequestHandlerClass
    receiver.server.server_close()
    otlp = ThreadingHTTPServer((host, otlp_port), handler)

    class Spans(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != "/spans":
                self.send_response(404)
                self.end_headers()
                return
            answer(self, "application/json", json.dumps(list(receiver.spans)).encode())

        def log_message(self, *args):
            pass

    spans = ThreadingHTTPServer((host, spans_port), Spans)
    for server in (otlp, spans):
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    return otlp, spans


def main() -> None:
    servers = serve()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"otlp receiver on :{OTLP_PORT} (/v1/traces, /v1/metrics), spans on :{SPANS_PORT}/spans", flush=True)
    stop.wait()
    for server in servers:
        server.shutdown()


if __name__ == "__main__":
    main()
