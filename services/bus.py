"""A service's one NATS boundary: the connection, trace context on every request-scoped
message (``kvpush.otel.messaging``), and the one place a received message becomes a typed value
or a refusal said on ``kvpush.invalid``.

    bus = await Bus.connect(url, name="scheduler-1")
    job = await bus.decoded(msg, wire.PrefillMessage)   # None: refused, the sender was told
    await bus.publish(wire.decode_job_subject(worker_id), wire.encode(job))   # span named by the template
"""

from __future__ import annotations

from typing import Awaitable, Callable

import msgspec
import nats
import structlog

from kvpush.otel.messaging import TEMPORARY, TracedNats
from kvpush.otel.metrics import instruments
from kvpush.shared import wire
from kvpush.shared.errors import BadMessage, ForgedSender, WrongParty, refusal
from kvpush.shared.nats_security import connect_options, error_logger, server_urls

log = structlog.get_logger("kvpush.bus")


class Bus(TracedNats):
    """``publish``, ``request`` and ``subscribe`` are traced (``TracedNats``); ``nc`` is the
    plain connection for periodic messages (heartbeats, status polls) that belong to no request."""

    def __init__(self, nc, service: str):
        super().__init__(nc)
        self.service = service

    @classmethod
    async def connect(cls, url: str, service: str, **callbacks) -> "Bus":
        """``callbacks``: nats-py's ``disconnected_cb``, ``reconnected_cb`` (async callables)."""
        nc = await nats.connect(server_urls(url), name=service, max_reconnect_attempts=-1,
                                error_cb=error_logger(service), **callbacks, **connect_options(service=service))
        return cls(nc, service)

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def decoded(self, msg, kind, decode: Callable = wire.decode, refuse_as: type[BadMessage] = BadMessage,
                      nack: bool = False):
        """``msg`` as ``kind``; or None, once the refusal is said on ``kvpush.invalid`` (and,
        with ``nack``, to the sender as a refused ``JobAck``). A message that names a sender
        other than its subject's is refused as forged (``wire.forged_sender``)."""
        try:
            message = decode(msg.data, kind)
        except msgspec.MsgspecError as exc:
            invalid = refusal(self.service, msg.subject, exc, refuse_as)
        else:
            forged = wire.forged_sender(msg.subject, message)
            if forged is None:
                return message
            invalid = refusal(self.service, msg.subject, ValueError(forged), ForgedSender)
        await self.refuse(invalid, msg, nack)
        return None

    async def refuse(self, invalid: wire.InvalidMessage, msg=None, nack: bool = False) -> None:
        """Log, count and say on ``kvpush.invalid`` that a message was refused."""
        log.warning("refused a message", subject=invalid.subject, code=invalid.code, error=invalid.reason)
        instruments().failures.add(1, {"reason": invalid.code})
        if nack and msg is not None and msg.reply:
            ack = wire.JobAck(accepted=False, error=wire.ErrorBody(invalid.code, f"malformed job: {invalid.reason}"))
            await self.publish(msg.reply, wire.encode(ack), template=TEMPORARY)
        await self.nc.publish(wire.INVALID_SUBJECT, wire.encode(invalid))

    async def wrong_party(self, msg, why: str) -> None:
        """Refuse a well-formed message from a peer that has no part in what it is about."""
        await self.refuse(refusal(self.service, msg.subject, ValueError(why), WrongParty))

    async def subscribe_plain(self, subject: str, cb: Callable[..., Awaitable[None]]):
        """A subscription without spans: for periodic messages that are part of no request."""
        return await self.nc.subscribe(subject, cb=cb)

    async def close(self) -> None:
        """Stop taking messages, finish the callbacks under way, and close."""
        await close_connection(self.nc)


async def close_connection(nc) -> None:
    """Drain ``nc`` (stop taking messages, finish the callbacks under way) and close it. A
    connection that is reconnecting cannot drain (nats-py raises): it is closed as it is, so a
    service stopping while its server is away still stops cleanly."""
    if nc.is_closed:
        return
    try:
        await nc.drain()
    except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError):
        await nc.close()
