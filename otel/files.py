"""Spans as OTLP-JSON lines in a local folder, when no OTLP endpoint is configured.

Each process appends to its own ``<service>-<pid>.jsonl``; each line is one OTLP
``ExportTraceServiceRequest`` in the OTLP/JSON encoding (hex ids, as the spec says).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def default_trace_dir() -> Path:
    explicit = os.environ.get("KVPUSH_TRACE_DIR")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("KVPUSH_CACHE_DIR", Path.home() / ".cache" / "kvpush"))
    return base / "traces"


def hex_ids(body: dict) -> dict:
    """Protobuf's JSON mapping writes ids as base64; OTLP/JSON wants hex. In place."""
    import base64

    for resource_spans in body.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64decode(span[key]).hex()
    return body


def to_otlp_json(spans: Sequence[ReadableSpan]) -> dict:
    return hex_ids(MessageToDict(encode_spans(spans)))


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, folder: Path, service_name: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{service_name}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()  # protects the file

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = json.dumps(to_otlp_json(spans), separators=(",", ":"))
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _value(attr: dict):
    value = attr.get("value", {})
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:
        return int(value["intValue"])
    return None


def flat_spans(body: dict) -> Iterator[dict]:
    """OTLP/JSON body -> flat span dicts: trace_id, span_id, parent_id, name, service,
    start_ns, end_ns, attributes (ids in hex)."""
    for resource_spans in body.get("resourceSpans", []):
        resource = {a["key"]: _value(a) for a in resource_spans.get("resource", {}).get("attributes", [])}
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                yield {
                    "trace_id": span["traceId"],
                    "span_id": span["spanId"],
                    "parent_id": span.get("parentSpanId") or None,
                    "name": span["name"],
                    "kind": span.get("kind", ""),
                    "service": resource.get("service.name", "?"),
                    "start_ns": int(span["startTimeUnixNano"]),
                    "end_ns": int(span["endTimeUnixNano"]),
                    "attributes": {a["key"]: _value(a) for a in span.get("attributes", [])},
                }


def read_spans(folder: Path) -> list[dict]:
    spans: list[dict] = []
    if not folder.exists():
        return spans
    for path in sorted(folder.glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    spans.extend(flat_spans(json.loads(line)))
                except (ValueError, KeyError):
                    continue  # a torn last line of a process that was killed
    return spans
