"""Client side of ``kvpush.generate``: publish with a reply inbox, read the stream.

A connection logged in as a named client (its inbox prefix ``_INBOX.<client>``, which
``kvpush.shared.nats_security.connect_options`` sets) sends on that client's own subjects,
``kvpush.generate.<client>``, ``kvpush.cancel.<client>`` and ``kvpush.final.<client>``.

Core NATS delivers at most once. When nothing has come for ``refetch_after_s``, the
client asks for the request's final again (``kvpush.final``): a final it missed is kept
for ``wire.FINALS_KEEP_S`` after the request ended. Token chunks lost on the way cannot be
asked for again: each carries its ``seq`` and the final their count, so a gap ends the
request with ``stream_lost`` instead of an answer with tokens missing. A stream that moved
to another decode mid-way goes on with the next seq; a seq that came already (the old
decode's, sent while it was being stopped) is dropped: the first chunk for a place stands
(``kvpush.shared.stream``: decode counts what it sends the same way). A request itself
can be lost on its way too: when no scheduler knows it (``NotFound``, not ``InFlight``)
and nothing came back, the client sends it again, up to ``RESENDS`` times; the schedulers
take a repeat (same id, same inbox) for the request they have. NATS's "no responders" is
sent again for ``NO_SCHEDULER_GRACE_S`` before it becomes ``NoScheduler``: when a server of
a cluster dies, the schedulers that were on it are back on another within a reconnect
(0.2-2 s), and a request sent in between should be served, not refused.

Each reply is decoded once, into ``wire.Reply`` (``TokenChunk``, ``FinalReply`` or
``ErrorReply``): callers get structs, and tell them apart with ``match``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable

from kvpush.shared import wire
from kvpush.shared.errors import InFlight, NoScheduler, NotFound, PayloadTooLarge, StreamLost, to_error_body
from kvpush.shared.stream import Arrival, StreamSoFar


REFETCH_AFTER_S = 5.0
RESENDS = 2  # times a request no scheduler knows of is sent again
NO_SCHEDULER_GRACE_S = 3.0  # how long "no responders" is asked again: a NATS failover's reconnects
FORGOTTEN_AFTER = 2  # NotFound answers in a row that end a request which had streamed
_NOT_KEPT = (InFlight.code, NotFound.code)  # kvpush.final's answers that hold no final


async def generate(nc, body: dict | bytes, timeout: float = 120.0, refetch_after_s: float = REFETCH_AFTER_S,
                   received: Callable[[wire.Reply], bool] | None = None,
                   headers: dict[str, str] | None = None,
                   no_scheduler_grace_s: float = NO_SCHEDULER_GRACE_S) -> AsyncIterator[wire.Reply]:
    """Yield each reply for one request: ``TokenChunk``s, then its last message
    (``FinalReply`` or ``ErrorReply``).

    Raises TimeoutError when no message arrives for ``timeout`` seconds (nor a final
    when asked again), NoScheduler when nobody has listened on ``kvpush.generate`` for
    ``no_scheduler_grace_s``. Stopping
    early (breaking out, cancelling the task) cancels the request. A dict body without a
    ``request_id`` gets one, so that the final can be asked for again.

    ``received``: a hook for tests; a reply it returns False for counts as lost on the way.
    ``headers``: NATS headers for the request (a W3C ``traceparent`` joins its trace).
    """
    data, request_id = _prepared(body, nc.max_payload)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    request = _Request(nc, data, request_id, inbox, headers or None)
    finished = False
    loop = asyncio.get_running_loop()
    try:
        await request.send()
        heard_at = loop.time()
        while True:
            silent_for = loop.time() - heard_at
            if silent_for >= timeout:
                raise TimeoutError(f"no reply within {timeout} s")
            try:
                msg = await sub.next_msg(timeout=min(refetch_after_s, timeout - silent_for))
            except asyncio.TimeoutError:  # nats raises its own subclass
                last = await request.after_silence()
                if last is None:
                    continue
                finished = True
                yield last
                return
            if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                await request.refused(no_scheduler_grace_s)
                continue
            reply = wire.decode_reply(msg.data)
            request.request_id = request.request_id or reply.request_id
            heard_at = loop.time()
            if received is not None and not received(reply):
                continue
            match reply:
                case wire.TokenChunk(seq=seq):
                    match request.so_far.arrival(seq):
                        case Arrival.REPEAT:
                            # That place in the stream came already: a decode the stream migrated away
                            # from sent it while it was being stopped. The first one stands.
                            continue
                        case Arrival.GAP:
                            # A chunk before this one never came: what follows would be a wrong answer,
                            # so the request ends here with an error (and the finally cancels the rest).
                            yield _lost(request.request_id,
                                        f"token chunk {request.so_far.chunks} never arrived (chunk {seq} did)")
                            return
                    request.so_far.add(seq, reply.index, reply.token_ids, time.time())
                    yield reply
                case _:
                    finished = True
                    yield _unless_lost(reply, request.request_id, request.so_far.chunks)
                    return
    finally:
        await sub.unsubscribe()  # decode also notices: its next chunk meets no responders
        if not finished and request.request_id:
            await cancel(nc, request.request_id)


class _Request:
    """One request of ``generate``, as sent: sent again when it was lost on its way, or
    refused while no scheduler listened; and what its client has of its stream."""

    def __init__(self, nc, data: bytes, request_id: str | None, inbox: str, headers: dict[str, str] | None):
        self.nc, self.data, self.request_id, self.inbox, self.headers = nc, data, request_id, inbox, headers
        owner = client_of(nc)
        self.subject = wire.OWNED_GENERATE(client=owner) if owner else wire.GENERATE_SUBJECT
        self.so_far = StreamSoFar()  # the token chunks received
        self.sent_at: float | None = None  # loop time of the first send
        self.refusals = 0  # "no responders" answers so far
        self.resent = 0  # sends again of a request no scheduler knew
        self.unknown = 0  # answers in a row, after the stream began, that no scheduler knows it

    async def send(self) -> None:
        await self.nc.publish(self.subject, self.data, reply=self.inbox, headers=self.headers)
        if self.sent_at is None:
            self.sent_at = asyncio.get_running_loop().time()

    async def after_silence(self) -> wire.LastMessage | None:
        """Nothing came for a while: ask for the final again. The request's last message,
        if that ends it; None to wait on."""
        final = await ask_final(self.nc, self.request_id) if self.request_id else None
        code = _error_code(final)
        self.unknown = self.unknown + 1 if code == NotFound.code and self.so_far.chunks else 0
        if self.unknown >= FORGOTTEN_AFTER:
            # It streamed, so it arrived; now it is neither running nor kept: its end was
            # lost with a NATS server. Waiting on would only reach the timeout.
            return _lost(self.request_id, "no scheduler knows it any more, and its end was never kept")
        if code == NotFound.code and self.so_far.chunks == 0 and self.resent < RESENDS:
            # No scheduler knows it: the request was lost on its way (a NATS server died
            # with it). The same id on the same inbox: a scheduler that has it after all
            # takes this one for what it is, a repeat, and says nothing.
            await self.send()
            self.resent += 1
        if final is None or code in _NOT_KEPT:
            return None
        return _unless_lost(final, self.request_id, self.so_far.chunks)

    async def refused(self, grace_s: float) -> None:
        """NATS said nobody listens on ``kvpush.generate``: send it again, backing off,
        for ``grace_s`` after the first send (a failover's reconnects), then NoScheduler."""
        waited = asyncio.get_running_loop().time() - self.sent_at
        if self.so_far.chunks or waited >= grace_s:
            raise NoScheduler(f"no scheduler is listening on {wire.GENERATE_SUBJECT}: start one "
                              "(kvpush up, or kvpush scheduler) or check --nats-url")
        await asyncio.sleep(min(0.1 * 2 ** self.refusals, grace_s - waited))
        self.refusals += 1
        await self.send()


def _prepared(body: dict | bytes, max_payload: int) -> tuple[bytes, str | None]:
    """The request's bytes and id (a dict body without one gets one); too large for the
    server: PayloadTooLarge."""
    if isinstance(body, dict) and body.get("request_id") is None:
        body = {**body, "request_id": uuid.uuid4().hex}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if len(data) > max_payload:
        raise PayloadTooLarge(f"the request is {len(data)} bytes, over the NATS server's max_payload of "
                              f"{max_payload} bytes; send a shorter prompt or raise max_payload")
    return data, body.get("request_id") if isinstance(body, dict) else None


def _unless_lost(final: wire.LastMessage, request_id: str | None, received: int) -> wire.LastMessage:
    """The final, or an error if chunks it counts never came (the stream's end was lost)."""
    match final:
        case wire.FinalReply(chunks=sent) if sent != received:
            return _lost(request_id or final.request_id, f"{sent - received} of its {sent} token chunks never arrived")
    return final


def _lost(request_id: str | None, what: str) -> wire.ErrorReply:
    error = StreamLost(f"the stream of request {request_id} lost tokens on the way: {what}; the output is "
                       "incomplete, send the request again")
    return wire.ErrorReply(request_id or "", to_error_body(error))


def _error_code(reply: wire.LastMessage | None) -> str | None:
    """The code of an ErrorReply; None for anything else."""
    match reply:
        case wire.ErrorReply(error=error):
            return error.code
    return None


async def cancel(nc, request_id: str) -> None:
    """Ask the schedulers to stop ``request_id`` wherever it is."""
    owner = client_of(nc)
    subject = wire.OWNED_CANCEL(client=owner) if owner else wire.CANCEL_SUBJECT
    await nc.publish(subject, wire.encode_json(wire.CancelRequest(request_id)))


async def fetch_final(nc, request_id: str, timeout: float = 2.0) -> wire.LastMessage | None:
    """The request's final message again (``kvpush.final``); None if none is kept (the
    request has not ended, ended long ago, or no scheduler answers)."""
    final = await ask_final(nc, request_id, timeout)
    return None if _error_code(final) in _NOT_KEPT else final


async def ask_final(nc, request_id: str, timeout: float = 2.0) -> wire.LastMessage | None:
    """The request's final message again, or the schedulers' ErrorReply that says what
    they know instead: ``InFlight`` (not ended yet), ``NotFound`` (no scheduler knows it:
    it never arrived, or ended long ago); None if no scheduler answered."""
    owner = client_of(nc)
    subject = wire.OWNED_FINAL(client=owner) if owner else wire.FINAL_SUBJECT
    try:
        msg = await nc.request(subject, wire.encode_json(wire.FinalRequest(request_id)), timeout=timeout)
    except Exception:  # no responders, or timeout: asked again on the next silence
        return None
    return wire.decode_last(msg.data)


def client_of(nc) -> str:
    """The client a connection is logged in as, read from its inbox prefix
    (``_INBOX.<client>``); "" for an anonymous one. nats-py keeps the prefix in
    ``_inbox_prefix``, with no public accessor."""
    prefix = bytes(getattr(nc, "_inbox_prefix", b"")).decode()
    head, _, name = prefix.partition(".")
    return name if head == wire.CLIENT_INBOX_PREFIX else ""


async def generate_all(nc, body: dict | bytes, timeout: float = 120.0) -> tuple[list[int], str, wire.LastMessage]:
    """(all token ids, all text, last message) for one request."""
    token_ids: list[int] = []
    text = []
    async for reply in generate(nc, body, timeout):
        match reply:
            case wire.TokenChunk():
                token_ids.extend(reply.token_ids)
                text.append(reply.text)
            case _:
                final = reply
    return token_ids, "".join(text), final


async def scheduler_status(nc, timeout: float = 2.0) -> wire.SchedulerStatus:
    """Ask any scheduler which workers it routes to (raises nats' NoResponders/Timeout errors)."""
    owner = client_of(nc)
    subject = wire.OWNED_STATUS(client=owner) if owner else wire.SCHEDULER_STATUS_SUBJECT
    msg = await nc.request(subject, b"", timeout=timeout)
    return wire.decode_json(msg.data, wire.SchedulerStatus)
