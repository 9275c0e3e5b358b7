"""Client side of ``kvpush.generate``: publish with a reply inbox, read the stream.

A connection logged in as a named client (its inbox prefix ``_INBOX.<client>``, which
``shared.nats_security.connect_options`` sets) sends on that client's own subjects,
``kvpush.generate.<client>``, ``kvpush.cancel.<client>`` and ``kvpush.final.<client>``.

Core NATS delivers at most once. When nothing has come for ``refetch_after_s``, the
client asks for the request's final again (``kvpush.final``): a final it missed is kept
for ``wire.FINALS_KEEP_S`` after the request ended. Token chunks lost on the way cannot be
asked for again: each carries its ``seq`` and the final their count, so a gap ends the
request with ``stream_lost`` instead of an answer with tokens missing. A request itself
can be lost on its way too: when no scheduler knows it (``not_found``, not ``in_flight``)
and nothing came back, the client sends it again, up to ``RESENDS`` times; the schedulers
take a repeat (same id, same inbox) for the request they have."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator, Callable

import msgspec

from shared import wire
from shared.errors import NoScheduler, PayloadTooLarge, StreamLost


REFETCH_AFTER_S = 5.0
RESENDS = 2  # times a request no scheduler knows of is sent again
FORGOTTEN_AFTER = 2  # "not_found" answers in a row that end a request which had streamed


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
    chunks = 0  # token chunks received: the next one's seq
    owner = client_of(nc)
    loop = asyncio.get_running_loop()
    try:
        subject = wire.OWNED_GENERATE(client=owner) if owner else wire.GENERATE_SUBJECT
        await nc.publish(subject, data, reply=inbox, headers=headers or None)
        resent = 0
        unknown = 0  # answers in a row, after the stream began, that no scheduler knows it
        heard_at = loop.time()
        while True:
            silent_for = loop.time() - heard_at
            if silent_for >= timeout:
                raise TimeoutError(f"no reply within {timeout} s")
            try:
                msg = await sub.next_msg(timeout=min(refetch_after_s, timeout - silent_for))
            except asyncio.TimeoutError:  # nats raises its own subclass
                final = await ask_final(nc, request_id) if request_id else None
                unknown = unknown + 1 if final == "not_found" and chunks else 0
                if unknown >= FORGOTTEN_AFTER:
                    # It streamed, so it arrived; now it is neither running nor kept: its end
                    # was lost with a NATS server. Waiting on would only reach the timeout.
                    finished = True
                    yield _lost(request_id, "no scheduler knows it any more, and its end was never kept")
                    return
                if final == "not_found" and chunks == 0 and resent < RESENDS:
                    # No scheduler knows it: the request was lost on its way (a NATS server
                    # died with it). The same id on the same inbox: a scheduler that has it
                    # after all takes this one for what it is, a repeat, and says nothing.
                    await nc.publish(subject, data, reply=inbox, headers=headers or None)
                    resent += 1
                if not isinstance(final, dict):
                    continue
                finished = True
                yield _unless_lost(final, request_id, chunks)
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
            if finished:
                yield _unless_lost(reply, request_id, chunks)
                return
            if reply.get("seq", chunks) != chunks:
                # A chunk before this one never came: what follows would be a wrong answer,
                # so the request ends here with an error (and the finally cancels the rest).
                yield _lost(request_id, f"token chunk {chunks} never arrived (chunk {reply.get('seq')} did)")
                return
            chunks += 1
            yield reply
    finally:
        await sub.unsubscribe()  # decode also notices: its next chunk meets no responders
        if not finished and request_id:
            await cancel(nc, request_id)


def _unless_lost(final: dict, request_id: str | None, received: int) -> dict:
    """The final, or an error if chunks it counts never came (the stream's end was lost)."""
    sent = final.get("chunks", received)
    if "error" in final or sent == received:
        return final
    return _lost(request_id or final.get("request_id", ""),
                 f"{sent - received} of its {sent} token chunks never arrived")


def _lost(request_id: str | None, what: str) -> dict:
    error = StreamLost(f"the stream of request {request_id} lost tokens on the way: {what}; the output is "
                       "incomplete, send the request again")
    return msgspec.to_builtins(wire.ErrorReply(request_id or "", wire.ErrorBody(error.code, str(error))))


async def cancel(nc, request_id: str) -> None:
    """Ask the schedulers to stop ``request_id`` wherever it is."""
    owner = client_of(nc)
    subject = wire.OWNED_CANCEL(client=owner) if owner else wire.CANCEL_SUBJECT
    await nc.publish(subject, wire.encode_json(wire.CancelRequest(request_id)))


async def fetch_final(nc, request_id: str, timeout: float = 2.0) -> dict | None:
    """The request's final message again (``kvpush.final``); None if none is kept (the
    request has not ended, ended long ago, or no scheduler answers)."""
    final = await ask_final(nc, request_id, timeout)
    return final if isinstance(final, dict) else None


async def ask_final(nc, request_id: str, timeout: float = 2.0) -> dict | str | None:
    """The request's final message again, or what the schedulers know instead:
    ``"in_flight"`` (not ended yet), ``"not_found"`` (no scheduler knows it: it never
    arrived, or ended long ago); None if no scheduler answered."""
    owner = client_of(nc)
    subject = wire.OWNED_FINAL(client=owner) if owner else wire.FINAL_SUBJECT
    try:
        msg = await nc.request(subject, wire.encode_json(wire.FinalRequest(request_id)), timeout=timeout)
    except Exception:  # no responders, or timeout: asked again on the next silence
        return None
    reply = json.loads(msg.data)
    code = reply.get("error", {}).get("code")
    return code if code in ("in_flight", "not_found") else reply


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
    owner = client_of(nc)
    subject = wire.OWNED_STATUS(client=owner) if owner else wire.SCHEDULER_STATUS_SUBJECT
    msg = await nc.request(subject, b"", timeout=timeout)
    return wire.decode_json(msg.data, wire.SchedulerStatus)
