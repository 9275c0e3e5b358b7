"""The transfer outcomes share their fields through one base struct (``wire.TransferOutcome``)
and still travel exactly as the flat structs they were: the same tag, the same keys in the
same order, so the msgpack is the same byte for byte and a peer of either layout reads the
other's."""

from __future__ import annotations

import msgspec
import pytest

from kvpush.shared import wire

pytestmark = pytest.mark.unit

SHARED = {"transfer_id": "t-1", "prefill_engine_id": "prefill-0", "decode_engine_id": "decode-1"}
# Each outcome as the flat layout encoded it: its tag first, then its fields in declaration
# order, the inherited protocol version last.
FLAT = [
    {"type": "TransferDone", **SHARED, "rank": 1, "order": "prefill_first", "waited_ms": 2.5, "bytes": 4096,
     "descriptors": 3, "write_ms": 1.25, "finished_at": 17.0, "version": wire.PROTOCOL_VERSION},
    {"type": "TransferFailed", **SHARED, "rank": 0, "code": "write_failed", "reason": "agent gone",
     "version": wire.PROTOCOL_VERSION},
    {"type": "TransferMoved", **SHARED, "moved": False, "reason": "write began", "version": wire.PROTOCOL_VERSION},
]


@pytest.mark.parametrize("flat", FLAT, ids=[flat["type"] for flat in FLAT])
def test_an_outcome_encodes_as_the_flat_layout_did_and_reads_it_back(flat):
    old = msgspec.msgpack.encode(flat)
    message = wire.decode(old, wire.Completion)
    assert type(message).__name__ == flat["type"]
    assert wire.encode(message) == old
    assert list(msgspec.msgpack.decode(wire.encode(message))) == list(flat)


def test_an_older_peers_moved_without_a_reason_still_reads():
    old = msgspec.msgpack.encode({"type": "TransferMoved", **SHARED, "moved": True, "version": 6})
    assert wire.decode(old, wire.Completion) == wire.TransferMoved(**SHARED, moved=True, version=6)


@pytest.mark.parametrize("flat", FLAT, ids=[flat["type"] for flat in FLAT])
def test_an_outcome_names_its_reporter_as_its_sender(flat):
    message = wire.decode(msgspec.msgpack.encode(flat), wire.Completion)
    assert wire.forged_sender(wire.completion_subject("decode-1", "prefill-0"), message) is None
    assert wire.forged_sender(wire.completion_subject("decode-1", "prefill-9"), message) is not None
