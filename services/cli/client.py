"""Client side of ``kvpush.generate``: publish with a reply inbox, read the stream.

A connection logged in as a named client (its inbox prefix ``_INBOX.<client>``, which
``shared.nats_security.connect_options`` sets) sends on that client's own subjects,
``kvpush.generate.<client>``, ``kvpush.cancel.<client>`` and ``kvpush.final.<client>``.

Core NATS delivers at most once. When nothing has come for ``refetch_after_s``, the
client asks for the request's final again (``kvpush.final``): a final it missed is kept
for ``wire.FINALS_KEEP_S`` after the request ended."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator, Callable

from shared import wire
from shared.errors import NoScheduler, PayloadTooLarge


REFETCH_AFTER_S = 5.0


async def generate(nc, body: dict | bytes, timeout: float = 120.0, refetch_after_s: float = REFETCH_AFTER_S,
                   received: Callable[[dict], bool] | None = None,
                   headers: dict[str, str] | None = None) -> AsyncIterator[dict]:
    """Yield each reply (token chunks, then the final message) for one request.

    Raises TimeoutError when no message arrives for ``timeout`` seconds (nor a final
    when asked again), NoScheduler when nobody listens on ``kvpush.generate``. Stopping
    early (breaking out, cancelling the task) cancels the request. A dict body without a
    ``request_id`` gets one, so that the final can be asked for again.

    ``received``: a hook for tests; a reply it returns False for counts as lost on the way.
    ``headers``: NATS headers for the request (a W3C ``traceparent`` joins its trace).
    """
    if isinstance(body, dict) and body.get("request_id") is None:
        body = {**body, "request_id": uuid.uuid4().hex}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if len(data) > nc.max_payload:
        raise PayloadTooLarge(f"the request is {len(data)} bytes, over the NATS server's max_payload of "
                              f"{nc.max_payload} bytes; send a shorter prompt or raise max_payload")
    request_id = body.get("request_id") if isinstance(body, dict) else None
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    finished = False
    owner = client_of(nc)
    loop = asyncio.get_running_loop()
    try:
        await nc.publish(wire.OWNED_GENERATE(client=owner) if owner else wire.GENERATE_SUBJECT, data, reply=inbox,
                         headers=headers or None)
        heard_at = loop.time()
        while True:
            silent_for = loop.time() - heard_at
            if silent_for >= timeout:
                raise TimeoutError(f"no reply within {timeout} s")
            try:
                msg = await sub.next_msg(timeout=min(refetch_after_s, timeout - silent_for))
            except asyncio.TimeoutError:  # nats raises its own subclass
                final = await fetch_final(nc, request_id) if request_id else None
                if final is None:
                    continue
                finished = True
                yield final
                return
            if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                raise NoScheduler(f"no scheduler is listening on {wire.GENERATE_SUBJECT}: start one "
                                  "(kvpush up, or kvpush scheduler) or check --nats-url")
            reply = json.loads(msg.data)
            request_id = request_id or reply.get("request_id")
            heard_at = loop.time()
            if received is not None and not received(reply):
                continue
            finished = bool(reply.get("finished"))
            yield reply
            if finished:
                return
    finally:
        await sub.unsubscribe()  # decode also notices: its next chunk meets no responders
        if not finished and request_id:
            await cancel(nc, request_id)


async def cancel(nc, request_id: str) -> None:
    """Ask the schedulers to stop ``request_id`` wherever it is."""
    owner = client_of(nc)
    subject = wire.OWNED_CANCEL(client=owner) if owner else wire.CANCEL_SUBJECT
    await nc.publish(subject, wire.encode_json(wire.CancelRequest(request_id)))


async def fetch_final(nc, request_id: str, timeout: float = 2.0) -> dict | None:
    """The request's final message again (``kvpush.final``); None if none is kept (the
    request has not ended, ended long ago, or no scheduler answers)."""
    owner = client_of(nc)
    subject = wire.OWNED_FINAL(client=owner) if owner else wire.FINAL_SUBJECT
    try:
        msg = await nc.request(subject, wire.encode_json(wire.FinalRequest(request_id)), timeout=timeout)
    except Exception:  # no responders, or timeout: asked again on the next silence
        return None
    reply = json.loads(msg.data)
    if reply.get("error", {}).get("code") == "not_found":
        return None
    return reply


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
