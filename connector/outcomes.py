"""How a transfer's end is told, by either half of the worker side: metrics for KV that
moved, and a ``TransferFailed`` (code and reason from a ``kvpush.shared.errors.TransferError``)
for KV that will not."""

from __future__ import annotations

import logging

from kvpush.connector.bridge import NatsBridge
from kvpush.connector.transfer_thread import TransferResult
from kvpush.otel.metrics import instruments
from kvpush.shared import wire
from kvpush.shared.errors import TransferError

log = logging.getLogger("kvpush.connector")


def record_transfer(result: TransferResult) -> None:
    metrics = instruments()
    metrics.transfer_bytes.record(result.bytes)
    metrics.transfer_duration.record(result.write_ms)
    metrics.descriptors.record(result.descriptors)


def report_failure(bridge: NatsBridge, engine_id: str, rank: int, transfer_id: str, decode_engine_id: str,
                   error: TransferError) -> None:
    """Tell decode (and the schedulers) that no copy of this rank's will land for this transfer."""
    log.warning("transfer %s failed (%s): %s", transfer_id, error.code, error.message)
    instruments().failures.add(1, {"reason": error.code})
    bridge.publish(
        wire.completion_subject(decode_engine_id or "unknown", engine_id),
        wire.encode(
            wire.TransferFailed(
                transfer_id=transfer_id,
                prefill_engine_id=engine_id,
                decode_engine_id=decode_engine_id,
                rank=rank,
                code=error.code,
                reason=error.message,
            )
        ),
    )
