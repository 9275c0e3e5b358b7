"""kvpush's exceptions; the ``code`` of each is what goes on the wire.

    KvpushError
    ├── RequestError            the client's request is unusable (never retried)
    │   ├── BadJson             body is not JSON / not an object
    │   ├── InvalidField        unknown field, wrong type, out-of-range value
    │   ├── EmptyPrompt
    │   ├── PromptTooLong       prompt does not fit the model's context
    │   └── PayloadTooLarge     bigger than the NATS server accepts
    ├── Overloaded              the scheduler holds as many requests as it may (retry later)
    ├── NoWorkers               no live prefill or decode worker to dispatch to
    │   └── NoScheduler         (client side) nobody listens on kvpush.generate
    ├── DispatchFailed          a worker did not accept the job
    ├── EngineFailed            the engine raised while serving the request
    ├── KvTransferFailed        the prompt's KV did not arrive and the policy is to fail
    ├── Cancelled               the client cancelled the request
    ├── DeadlineExceeded        no final answer within the deadline
    ├── WorkerLost              a worker died after tokens went out (a retry would repeat them)
    ├── StreamLost              (client side) token chunks were lost on the way
    ├── InFlight                (kvpush.final) the request has not ended yet
    ├── NotFound                (kvpush.final) no last message is kept for that request id
    ├── LedgerUnavailable       JetStream did not take a flight's record
    ├── BadMessage              an internal message that does not decode (said on kvpush.invalid)
    │   ├── BadJob              ...a job, refused to the scheduler that sent it
    │   ├── InvalidReply        ...a request whose reply subject is not the client's own inbox
    │   ├── ForgedSender        ...names a sender other than the one its subject proves
    │   └── WrongParty          ...comes from a peer that has no part in that transfer
    └── TransferError           one transfer's KV will not be written or read (TransferFailed.code)
        ├── LeaseExpired        decode did not renew prefill's lease on the blocks
        ├── TpMismatch          the two tensor-parallel sizes cannot split the KV heads between them
        ├── BadRegistration     the registration does not fit the prompt or the blocks
        ├── TransferClosed      a registration for a transfer already given up
        ├── Revoked             decode gave the transfer up
        ├── AgentUnreachable    the peer's NIXL agent could not be had
        ├── WriteFailed         the WRITE failed
        │   └── WriteStuck      ...never ended: it may still land, so decode keeps the blocks
        ├── ReadFailed          pull: the READ failed
        └── PrefixNotHeld       a lend: the holder no longer has the prefix cached

``to_error_body`` is the one boundary that turns any exception into an error reply's body
(``wire.ErrorReply``; a client tells codes apart by these classes' ``code``), and
``refusal`` the one that turns a message that does not decode into an ``InvalidMessage``.
``http_status`` is the one mapping from a code to an HTTP status (the gateway's).
"""

from __future__ import annotations

from kvpush.shared.wire import ErrorBody, InvalidMessage


class KvpushError(Exception):
    code = "internal"
    http_status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RequestError(KvpushError):
    code = "invalid_request"
    http_status = 400


class BadJson(RequestError):
    code = "bad_json"


class InvalidField(RequestError):
    code = "invalid_field"


class EmptyPrompt(RequestError):
    code = "empty_prompt"


class PromptTooLong(RequestError):
    code = "prompt_too_long"


class PayloadTooLarge(RequestError):
    code = "payload_too_large"
    http_status = 413


class Overloaded(KvpushError):
    code = "overloaded"
    http_status = 429


class NoWorkers(KvpushError):
    code = "no_workers"
    http_status = 503


class NoScheduler(NoWorkers):
    code = "no_scheduler"


class DispatchFailed(KvpushError):
    code = "dispatch_failed"
    http_status = 503

    def __init__(self, message: str, worker_id: str = ""):
        super().__init__(message)
        self.worker_id = worker_id


class EngineFailed(KvpushError):
    code = "engine_failed"


class KvTransferFailed(KvpushError):
    code = "kv_transfer_failed"


class Cancelled(KvpushError):
    code = "cancelled"
    http_status = 499


class DeadlineExceeded(KvpushError):
    code = "deadline_exceeded"
    http_status = 504


class WorkerLost(KvpushError):
    code = "worker_lost"
    http_status = 502


class StreamLost(KvpushError):
    """Token chunks of the stream were lost on the way (core NATS delivers at most once,
    and a server that dies takes what it held): the output is incomplete."""

    code = "stream_lost"
    http_status = 502


class InFlight(KvpushError):
    """Asked for a request's last message (``kvpush.final``) before it ended: wait on."""

    code = "in_flight"
    http_status = 409


class NotFound(KvpushError):
    code = "not_found"
    http_status = 404


class LedgerUnavailable(KvpushError):
    code = "ledger_unavailable"
    http_status = 503


class BadMessage(KvpushError):
    code = "bad_message"


class BadJob(BadMessage):
    code = "bad_job"


class InvalidReply(BadMessage):
    code = "invalid_reply"


class ForgedSender(BadMessage):
    code = "forged_sender"


class WrongParty(BadMessage):
    code = "wrong_party"


class TransferError(KvpushError):
    code = "transfer_failed"


class LeaseExpired(TransferError):
    code = "lease_expired"


class TpMismatch(TransferError):
    """Prefill's and decode's tensor-parallel sizes cannot split the model's KV heads
    between their ranks (``kvpush.connector.tp_map.problem`` says why)."""

    code = "tp_mismatch"


class BadRegistration(TransferError):
    code = "bad_registration"


class TransferClosed(TransferError):
    code = "transfer_closed"


class Revoked(TransferError):
    code = "revoked"


class AgentUnreachable(TransferError):
    code = "agent_unreachable"


class WriteFailed(TransferError):
    code = "write_failed"


class WriteStuck(WriteFailed):
    code = "write_stuck"


class ReadFailed(TransferError):
    code = "read_failed"


class PrefixNotHeld(TransferError):
    """A lend refused before any READ: the engine asked no longer holds the prefix."""

    code = "prefix_not_held"


class ChecksumMismatch(TransferError):
    """The KV that landed on decode differs from prefill's checksum of it."""

    code = "checksum_mismatch"


def to_error_body(exc: BaseException) -> ErrorBody:
    if isinstance(exc, KvpushError):
        return ErrorBody(code=exc.code, message=exc.message)
    return ErrorBody(code="internal", message=f"internal error: {type(exc).__name__}: {exc}")


def refusal(service: str, subject: str, exc: BaseException, kind: type[BadMessage] = BadMessage) -> InvalidMessage:
    """What a service says on ``kvpush.invalid`` about a message it could not decode."""
    # str(): a wire.Subject is a str subclass, which msgspec does not encode
    return InvalidMessage(service=service, subject=str(subject), code=kind.code, reason=str(exc))


def _codes(cls: type[KvpushError]) -> dict[str, int]:
    statuses = {cls.code: cls.http_status}
    for sub in cls.__subclasses__():
        statuses.update(_codes(sub))
    return statuses


_HTTP_STATUS = _codes(KvpushError)


def http_status(code: str) -> int:
    """The HTTP status of an error code from the wire: 400 for the client's mistakes, 413,
    429 overloaded, 499 cancelled (nginx's "client closed request"), 503 nobody to serve
    it, 504 deadline, 5xx for failures on the way."""
    return _HTTP_STATUS.get(code, 500)
