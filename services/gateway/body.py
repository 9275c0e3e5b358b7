"""A request body, bounded whatever its transfer encoding (``Content-Length`` or chunked).

``await read_body(request, limit)`` returns the body, or raises ``BodyTooLarge`` the
moment it would pass ``limit`` bytes; never more than ``limit`` bytes are held.

What happens to the rest. A client reads the answer only once it has sent its body, and a
connection closed under a client still sending loses the answer (an asyncio client's
transport drops what it had received when its write fails). So a body at most ``drain``
bytes past the limit is read to its end and thrown away, and the 413 arrives whole on a
connection that stays open; a longer one (or one whose client waits for ``100 Continue``)
is not read further: the 413 says ``Connection: close`` and the gateway stops reading.
Memory stays at ``limit`` in both cases, and the bytes read at ``limit + drain``.
"""

from __future__ import annotations

from starlette.requests import Request

from kvpush.shared.errors import PayloadTooLarge


class BodyTooLarge(PayloadTooLarge):
    """``unread``: the rest of the body was left unread; the connection must close."""

    def __init__(self, message: str, unread: bool):
        super().__init__(message)
        self.unread = unread


async def read_body(http: Request, limit: int, drain: int | None = None) -> bytearray:
    """The body; ``drain``: how far past ``limit`` a body is still read, to be thrown away
    (default: ``limit`` again)."""
    drain = limit if drain is None else drain
    declared = http.headers.get("content-length")
    length = int(declared) if declared is not None and declared.isdigit() else None
    if length is not None and length > limit:
        too_large = f"the body is {length} bytes, over the {limit}-byte limit"
        waits = http.headers.get("expect", "").lower() == "100-continue"  # it sends nothing unless asked
        if waits or length > limit + drain:
            raise BodyTooLarge(too_large, unread=True)
        await _discard(http, 0, limit + drain)
        raise BodyTooLarge(too_large, unread=False)
    body = bytearray()
    stream = http.stream()
    async for chunk in stream:
        if len(body) + len(chunk) > limit:
            seen = len(body) + len(chunk)
            del body  # let go of what was held, then throw the rest away as it comes
            ended = await _discard(http, seen, limit + drain, stream)
            raise BodyTooLarge(f"the body is over the {limit}-byte limit (refused at {seen} bytes)",
                               unread=not ended)
        body += chunk
    return body


async def _discard(http: Request, seen: int, most: int, stream=None) -> bool:
    """Read and drop the rest of the body while no more than ``most`` bytes in all have
    come; True if it ended."""
    async for chunk in stream if stream is not None else http.stream():
        seen += len(chunk)
        if seen > most:
            return False
    return True
