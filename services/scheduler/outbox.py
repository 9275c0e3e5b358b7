"""What the scheduler says to workers and clients about a request: a job handed over and
acked, the cancel of a flight's jobs, an error final to its client."""

from __future__ import annotations

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvpush.otel import attributes as A
from kvpush.otel.messaging import TEMPORARY
from kvpush.otel.metrics import instruments
from kvpush.services.bus import Bus
from kvpush.services.ledger import Ledger
from kvpush.services.scheduler.flights import Flight
from kvpush.services.scheduler.timing import DISPATCH_TIMEOUT_S
from kvpush.shared import wire
from kvpush.shared.errors import DispatchFailed, PayloadTooLarge, to_error_body

log = structlog.get_logger("kvpush.scheduler")


class Outbox:
    def __init__(self, bus: Bus, ledger: Ledger):
        self.bus = bus
        self.ledger = ledger

    async def send(self, worker_id: str, job: wire.PrefillJob | wire.DecodeJob) -> None:
        """Hand a job to a worker and wait for its ack."""
        body = wire.encode(job)
        if len(body) > self.bus.max_payload:
            raise PayloadTooLarge(
                f"the prompt makes a {len(body)}-byte job, over the NATS server's max_payload of "
                f"{self.bus.max_payload} bytes; raise max_payload or send a shorter prompt"
            )
        subject = (wire.prefill_job_subject if isinstance(job, wire.PrefillJob) else wire.decode_job_subject)(worker_id)
        if isinstance(job, wire.DecodeJob):  # where it claims its answer: there before it can
            await self.ledger.claims.ensure_stream(worker_id)
        try:
            reply = await self.bus.request(subject, body, DISPATCH_TIMEOUT_S)
        except Exception as exc:
            raise DispatchFailed(f"worker {worker_id} did not accept the job: {type(exc).__name__}",
                                 worker_id) from None
        ack = wire.decode(reply.data, wire.JobAck)
        if not ack.accepted:
            reason = ack.error.message if ack.error is not None else "it gave no reason"
            raise DispatchFailed(f"worker {worker_id} refused the job: {reason}", worker_id)

    async def lend(self, holder_id: str, job: wire.LendJob, timeout_s: float) -> wire.Lent:
        """Ask ``holder_id`` to lend a cached prefix; its answer (raises on no answer in time)."""
        reply = await self.bus.request(wire.LEND_JOBS(worker_id=holder_id), wire.encode(job), timeout_s)
        lent = wire.decode(reply.data, wire.Lent)
        if lent.holder_engine_id != holder_id or lent.transfer_id != job.transfer_id:
            raise ValueError(f"a lend answered for {lent.holder_engine_id}/{lent.transfer_id}")
        return lent

    async def prompt_ready(self, flight: Flight, ready: wire.PromptReady) -> None:
        """Push: prefill's word on the prompt, to the attempt's decode (no ack: a decode that
        ended no longer needs it, and one that waits for it is bounded by its own wait)."""
        body = wire.encode(ready)
        if len(body) > self.bus.max_payload:  # prompt logprobs are bounded well below it (validation)
            log.warning("prompt report too large to pass on", transfer_id=flight.transfer_id, size=len(body))
            return
        await self.bus.publish(wire.decode_job_subject(flight.decode_id), body)

    async def cancel_jobs(self, flight: Flight, reason: str, error: wire.ErrorBody | None = None) -> None:
        """Tell the flight's current workers to drop the request (queued or running).
        ``error``: what the decode tells the client, if it holds the answer's claim."""
        cancel = wire.encode(wire.CancelJob(request_id=flight.request_id, transfer_id=flight.transfer_id,
                                            reason=reason, error=error))
        if flight.prefill_id:
            await self.bus.publish(wire.prefill_job_subject(flight.prefill_id), cancel)
        if flight.decode_id:
            await self.bus.publish(wire.decode_job_subject(flight.decode_id), cancel)

    async def reply_error(self, reply_to: str, request_id: str, exc: BaseException,
                          keep_for: str | None = None, kept_as: str | None = None) -> None:
        """Send the client an error final; ``keep_for`` (the flight's owner): keep it for
        ``kvpush.final`` first (under ``kept_as``, by default the request id), so a client
        that misses it can fetch it."""
        body = to_error_body(exc)
        log.info("request rejected", request_id=request_id, code=body.code, message=body.message)
        span = trace.get_current_span()
        span.set_attributes({A.REQUEST_ID: request_id, A.ERROR_CODE: body.code})
        span.set_status(Status(StatusCode.ERROR, body.message))
        instruments().failures.add(1, {"reason": body.code})
        instruments().requests.add(1, {"outcome": "error"})
        data = wire.encode_json(wire.ErrorReply(request_id, body))
        if keep_for is not None:
            await self.ledger.keep_final(keep_for, kept_as or request_id, data, reply_to)
        await self.bus.publish(reply_to, data, template=TEMPORARY)
