"""Trace context at the NATS boundary, and nowhere else.

Publishing starts a PRODUCER span ``publish <subject template>`` and injects W3C trace
context into the message headers; receiving extracts it and runs the handler inside a
CONSUMER span ``process <subject template>``, with ``trace_id`` bound for structlog.
Templates keep worker ids and reply inboxes out of span names.
"""

from __future__ import annotations

import contextlib
from typing import Awaitable, Callable

import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

_tracer = trace.get_tracer("kvpush.messaging")

TEMPORARY = "(temporary)"  # a reply inbox, per the messaging conventions


def template_of(subject: str, template: str | None = None) -> str:
    """The name a span gives ``subject``: the template it was made from (``wire.Subject``)."""
    return template or getattr(subject, "template", None) or subject


def _attributes(subject: str, template: str, operation: str) -> dict:
    attrs = {
        "messaging.system": "nats",
        "messaging.operation.type": operation,
        "messaging.destination.name": subject,
        "messaging.destination.template": template,
    }
    if template == TEMPORARY:
        attrs["messaging.destination.temporary"] = True
    return attrs


def trace_id_hex(span: trace.Span | None = None) -> str:
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


@contextlib.contextmanager
def producer(subject: str, template: str | None = None, parent: otel_context.Context | None = None,
             headers: dict[str, str] | None = None):
    """Span for one publish; yields the headers carrying its context."""
    headers = dict(headers or {})
    template = template_of(subject, template)
    with _tracer.start_as_current_span(
        f"publish {template}", context=parent, kind=SpanKind.PRODUCER,
        attributes=_attributes(subject, template, "publish"),
    ):
        propagate.inject(headers)
        yield headers


@contextlib.contextmanager
def consumer(subject: str, template: str | None, headers: dict[str, str] | None):
    """Span for handling one received message, parented by the sender's context."""
    parent = propagate.extract(headers or {})
    template = template_of(subject, template)
    with _tracer.start_as_current_span(
        f"process {template}", context=parent, kind=SpanKind.CONSUMER,
        attributes=_attributes(subject, template, "process"),
    ) as span:
        with structlog.contextvars.bound_contextvars(trace_id=trace_id_hex(span)):
            yield span


def context_from_traceparent(traceparent: str | None) -> otel_context.Context | None:
    if not traceparent:
        return None
    return propagate.extract({"traceparent": traceparent})


def current_traceparent() -> str:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


class TracedNats:
    """A nats-py connection whose publish/request/subscribe carry trace context."""

    def __init__(self, nc):
        self.nc = nc

    async def publish(self, subject: str, data: bytes, template: str | None = None, reply: str = "") -> None:
        with producer(subject, template) as headers:
            await self.nc.publish(subject, data, reply=reply, headers=headers)

    async def request(self, subject: str, data: bytes, timeout: float, template: str | None = None):
        with producer(subject, template) as headers:
            return await self.nc.request(subject, data, timeout=timeout, headers=headers)

    async def subscribe(self, subject: str, cb: Callable[..., Awaitable[None]], template: str | None = None,
                        queue: str = ""):
        template = template_of(subject, template)

        async def traced(msg) -> None:
            with consumer(msg.subject, template, msg.headers):
                await cb(msg)

        return await self.nc.subscribe(subject, queue=queue, cb=traced)
