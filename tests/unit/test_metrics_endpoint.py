"""otel/endpoint.py on a real socket: /health as soon as it serves, /ready only once the
process says it serves (``mark_ready``), /metrics in Prometheus' format."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from kvpush.otel import endpoint


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_ready_only_after_mark_ready_while_health_answers_from_the_start():
    endpoint.READY.clear()
    server = endpoint.serve(0, service="kvpush-worker")
    port = server.server_address[1]
    try:
        assert get(port, "/health")[0] == 200
        status, body = get(port, "/ready")
        assert (status, json.loads(body)["status"]) == (503, "starting")
        endpoint.mark_ready()
        status, body = get(port, "/ready")
        assert (status, json.loads(body)) == (200, {"status": "ready", "service": "kvpush-worker"})
        assert get(port, "/nothing")[0] == 404
        assert get(port, "/metrics")[0] == 200
    finally:
        server.shutdown()
        endpoint.READY.clear()
