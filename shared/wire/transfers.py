"""The KV plane's messages (msgpack), between the connectors of two engines and from a
scheduler to a prefill's: where an engine's NIXL agent is, which blocks to write into (or
keep, or give up), where a transfer goes instead, and how each transfer ended.

A transfer's ``transfer_key`` is a secret the scheduler gives only the two workers it
chose (on their private job subjects). Registrations and revokes carry it, and every
NIXL notification carries a tag made with it over the receiver's block ids
(``kvpush.connector.completion``): a completion is accepted only from the chosen peer, for the
blocks the receiver itself named.

Pure: imports no NATS.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from kvpush.shared.wire.internal import Internal


class KvRegion(msgspec.Struct, array_like=True):
    """One run of equally sized blocks in registered memory: block b lives at
    ``base_addr + b * block_stride`` and is ``block_len`` bytes long."""

    base_addr: int
    block_stride: int
    block_len: int


class AgentInfo(Internal):
    sender_field: ClassVar[str] = "engine_id"

    engine_id: str
    rank: int
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    device_id: int
    num_blocks: int
    regions: list[KvRegion]
    incarnation: str = ""  # the engine's start this agent belongs to
    # Tensor parallelism: the engine's size, and the KV heads this rank's blocks hold,
    # [head_start, head_start + heads), outermost in each block (heads 0: not known, or not
    # outermost: its blocks move only whole, between equal sizes).
    tp_size: int = 1
    head_start: int = 0
    heads: int = 0


class Registration(Internal):
    """Decode allocated ``block_ids`` for the prompt of ``transfer_id``; push into them,
    through the agent of ``decode_incarnation`` only (an earlier process of the same
    engine id has other memory).

    With prefix caching, decode already holds the prompt's first ``first_block`` blocks
    (its own cache, shared with other requests: never a destination); ``block_ids`` are
    for the prompt's blocks from ``first_block`` on."""

    sender_field: ClassVar[str] = "decode_engine_id"

    transfer_id: str
    request_id: str
    decode_engine_id: str
    decode_request_id: str
    decode_tp_size: int
    block_ids: list[int]
    num_tokens: int
    registered_at: float
    transfer_key: str = ""
    decode_incarnation: str = ""
    first_block: int = 0
    kv_heads: int = 0  # the model's KV heads, all ranks together (0: not said; only an equal TP then)


class LeaseRenewal(Internal):
    """Decode still wants these transfers: prefill keeps their blocks a lease longer."""

    sender_field: ClassVar[str] = "decode_engine_id"

    decode_engine_id: str
    transfer_ids: list[str]


class Revoke(Internal):
    """Decode gave the blocks of ``transfer_id`` up: start no write into them, and answer
    (a completion event) once no write of ours can still land in them."""

    sender_field: ClassVar[str] = "decode_engine_id"

    transfer_id: str
    decode_engine_id: str
    reason: str
    transfer_key: str = ""


KvControl = Registration | LeaseRenewal | Revoke


class MoveTransfer(Internal):
    """The decode chosen for ``transfer_id`` was lost or overloaded before its KV was
    written: push it to ``decode_engine_id`` instead, whose registration carries
    ``new_transfer_key``; nothing is recomputed. Only a scheduler may send it (NATS
    permissions on ``kvpush.kv.move.*.<scheduler>``). Answered with a TransferMoved."""

    sender_field: ClassVar[str] = "scheduler_id"

    transfer_id: str
    scheduler_id: str
    transfer_key: str  # the transfer's key until now: proves the scheduler is the transfer's
    decode_engine_id: str
    new_transfer_key: str


RendezvousOrder = Literal["registration_first", "prefill_first"]


class TransferOutcome(Internal):
    """How a transfer into ``decode_engine_id``'s blocks ended, on that engine's completion
    subject (``KV_COMPLETIONS``); the fields every outcome shares. ``prefill_engine_id`` is
    whoever reports it: the prefill, or decode for its own READ."""

    sender_field: ClassVar[str] = "prefill_engine_id"

    transfer_id: str
    prefill_engine_id: str
    decode_engine_id: str


class TransferDone(TransferOutcome):
    """Rank ``rank``'s share of the KV landed, in every decode rank it writes to: when, in
    what order the two sides met, and what it moved."""

    rank: int
    order: RendezvousOrder
    waited_ms: float
    bytes: int
    descriptors: int
    write_ms: float
    finished_at: float


class TransferFailed(TransferOutcome):
    """Rank ``rank``'s share of the KV did not land, and why (``code``, ``reason``). Sent
    once nothing of that rank can still land in any decode rank it writes to; which those
    are, decode reads from the rank's agent (``AgentInfo.tp_size``)."""

    rank: int
    code: str
    reason: str


class TransferMoved(TransferOutcome):
    """Prefill's answer to a MoveTransfer, on the new decode's completion subject:
    ``moved``, or why not (its write had begun, or the transfer was over)."""

    moved: bool
    reason: str = ""


Completion = TransferDone | TransferFailed | TransferMoved
