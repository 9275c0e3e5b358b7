"""Client side of ``kvpush.generate``: publish with a reply inbox, read the stream.

A connection logged in as a named client (its inbox prefix ``_INBOX.<client>``, which
``shared.nats_security.connect_options`` sets) sends on that client's own subjects,
``kvpush.generate.<client>`` and ``kvpush.cancel.<client>``."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from shared import wire
from shared.errors import NoScheduler, PayloadTooLarge


async def generate(nc, body: dict | bytes, timeout: float = 120.0) -> AsyncIterator[dict]:
    """Yield each reply (token chunks, then the final message) for one request.

    Raises TimeoutError when no message arrives for ``timeout`` seconds, NoScheduler when
    nobody listens on ``kvpush.generate``. Stopping early
    (breaking out, cancelling the task) cancels the request, if it has a request_id.
    """
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if len(data) > nc.max_payload:
        raise PayloadTooLarge(f"the request is {len(data)} bytes, over the NATS server's max_payload of "
                              f"{nc.max_payload} bytes; send a shorter prompt or raise max_payload")
    request_id = body.get("request_id") if isinstance(body, dict) else None
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    finished = False
    owner = client_of(nc)
    try:
        await nc.publish(wire.OWNED_GENERATE(client=owner) if owner else wire.GENERATE_SUBJECT, data, reply=inbox)
        while True:
            msg = await sub.next_msg(timeout=timeout)
            if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                raise NoScheduler(f"no scheduler is listening on {wire.GENERATE_SUBJECT}: start one "
                                  "(kvpush up, or kvpush scheduler) or check --nats-url")
            reply = json.loads(msg.data)
            finished = bool(reply.get("finished"))
            yield reply
            if finished:
                return
    except asyncio.TimeoutError as exc:  # nats raises its own subclass
        raise TimeoutError(f"no reply within {timeout} s") from exc
    finally:
        await sub.unsubscribe()  # decode also notices: its next chunk meets no responders
        if not finished and request_id:
            await cancel(nc, request_id)


async def cancel(nc, request_id: str) -> None:
    """Ask the schedulers to stop ``request_id`` wherever it is."""
    owner = client_of(nc)
    subject = wire.OWNED_CANCEL(client=owner) if owner else wire.CANCEL_SUBJECT
    await nc.publish(subject, wire.encode_json(wire.CancelRequest(request_id)))


def client_of(nc) -> str:
    """The client a connection is logged in as, read from its inbox prefix
    (``_INBOX.<client>``); "" for an anonymous one. nats-py keeps the prefix in
    ``_inbox_prefix``, with no public accessor."""
    prefix = bytes(getattr(nc, "_inbox_prefix", b"")).decode()
    head, _, name = prefix.partition(".")
    return name if head == wire.CLIENT_INBOX_PREFIX else ""


async def generate_all(nc, body: dict | bytes, timeout: float = 120.0) -> tuple[list[int], str, dict]:
    """(all token ids, all text, final message) for one request."""
    token_ids: list[int] = []
    text = []
    final: dict = {}
    async for reply in generate(nc, body, timeout):
        if reply.get("finished"):
            final = reply
        else:
            token_ids.extend(reply["token_ids"])
            text.append(reply["text"])
    return token_ids, "".join(text), final


async def scheduler_status(nc, timeout: float = 2.0) -> wire.SchedulerStatus:
    """Ask any scheduler which workers it routes to (raises nats' NoResponders/Timeout errors)."""
    msg = await nc.request(wire.SCHEDULER_STATUS_SUBJECT, b"", timeout=timeout)
    return wire.decode_json(msg.data, wire.SchedulerStatus)
