"""Encoding and decoding, once per type: msgpack for the services' messages (``encode``,
``decode``), JSON for the client's (``encode_json``, ``decode_json``, and the replies'
``decode_reply`` and ``decode_last``). Every decoder raises only msgspec's own errors on bad
input, so a receiver turns one ``except`` into an error event and keeps serving.

Pure: imports no NATS.
"""

from __future__ import annotations

import msgspec

from kvpush.shared.wire.public import LastMessage, Reply

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind):
    """Decode ``data`` as ``kind`` (a Struct type or a union of them).

    Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on bad input; callers
    turn those into an error event and keep serving.
    """
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return _guarded(decoder.decode, data)


def _guarded(decode, data: bytes):
    """msgspec raises UnicodeDecodeError on bad UTF-8 in a string and RecursionError on
    absurd nesting (msgspec issue #714); callers expect only its own errors."""
    try:
        return decode(data)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise msgspec.DecodeError(f"malformed: {type(exc).__name__}") from None


_json_encoder = msgspec.json.Encoder()
_json_decoders: dict[type, msgspec.json.Decoder] = {}


def encode_json(message: msgspec.Struct) -> bytes:
    return _json_encoder.encode(message)


def decode_json(data: bytes, kind):
    """Decode a public JSON message (``GenerateRequest``, ``CancelRequest``,
    ``SchedulerStatus``); raises msgspec's errors like ``decode``."""
    decoder = _json_decoders.get(kind)
    if decoder is None:
        decoder = _json_decoders[kind] = msgspec.json.Decoder(kind)
    return _guarded(decoder.decode, data)


_reply_decoder = msgspec.json.Decoder(Reply)
_last_decoder = msgspec.json.Decoder(LastMessage)


def decode_reply(data: bytes) -> Reply:
    """A message from a client's reply inbox; raises msgspec's errors like ``decode``."""
    return _guarded(_reply_decoder.decode, data)


def decode_last(data: bytes) -> LastMessage:
    """A ``kvpush.final`` answer (or a kept final); raises msgspec's errors like ``decode``."""
    return _guarded(_last_decoder.decode, data)
