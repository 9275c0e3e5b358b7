"""The prefill side's decisions about its transfers: whose key, where a move sends them,
what a revoke closes, what a peer's message may not touch. Pure bookkeeping.

No NATS, NIXL or vLLM; time comes from ``clock`` (or is passed in), so tests drive it
directly. The book does not lock: its owner (``kvpush.connector.producer``) holds one lock
around every call, for the calls come from vLLM's worker thread, the NATS thread, the
transfer thread and the lease clock. The book decides; its owner acts on the answer
(publishes, posts the WRITE, lets vLLM free blocks).

What it keeps, by transfer id: the rendezvous of a decode registration with a finished
prompt (push); the transfer's key and (pull) our blocks that a READ notification's tag
is made over, until the transfer ended; where a scheduler moved it, and the keys it had
before; a Revoke that came before either half, until one comes to check it against; the
transfers matched whose WRITE has not ended ("writing"); (pull) the blocks held for
decode's READ, under a lease. By request id: the prompts whose blocks are held, and
those that may go back. What a peer can grow is bounded (``Bounded``): past
``max_keys`` transfers, the oldest is forgotten.

Every refusal is a ``Refuse``: the message came from a peer that has no part in the
transfer (no key, or not its decode), and nothing was changed.

vLLM's worker thread
- ``prefill_ready(ready)`` -> ``Arrival``: the prompt as its transfer's newest move says;
  ``forged``: a revoke that came before it proved forged, and was undone.
- ``serve(ready)``: pull: hold the prompt's blocks for decode's READ, under a lease.
- ``offer_prefill(ready)``, and from NATS ``offer_registration(registration)``: the
  rendezvous's answer (``kvpush.connector.rendezvous``). A ``Match`` is marked writing in the
  same call, so a revoke never finds a match without its write.
- ``finished(request_ids)``: those vLLM finished whose blocks may go back now; ``busy()``.
- ``registration_waiting(transfer_id)``: layer by layer, a prompt is offered before its
  forward only to a registration already waiting (else its KV would be written unfinished).

The NATS thread
- ``registration_arrived(registration)`` -> ``Arrival``: ``moved_to``: the transfer moved
  away from this decode (do not offer it); ``forged``: as above.
- ``renew(transfer_id)``: decode's lease renewal, of a waiting half or a held read.
- ``revoke(revoke)`` -> ``Refuse`` | ``Revocation``: what to free and what to answer.
- ``move(move)`` -> ``Refuse`` | ``MoveAnswer``: only before the write, only push.

The transfer thread
- ``serves(transfer_id)``; ``read_notified(note)`` -> ``Refuse`` | ``Release`` | None: the
  blocks go back once every decode rank that reads this rank's heads notified.
- ``write_ended(transfer_id, request_id, ok)``; ``write_not_posted(transfer_id, request_id)``.
- ``give_back(request_id)``: the prompt's blocks hold nothing decode will take.

The lease clock
- ``expired()`` -> ``Expired`` each: waiting halves whose lease ran out (closed).
- ``lapsed_reads(now)``: (transfer id, request id) of held reads whose lease ran out.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

from kvpush.connector.completion import CompletionCounter, Notification, keys_match, tag_matches
from kvpush.connector.leases import ServedReads
from kvpush.connector.rendezvous import Match, Refused, Rendezvous
from kvpush.shared import wire

if TYPE_CHECKING:  # kvpush.connector.metadata imports vLLM
    from kvpush.connector.metadata import ReadyPrefill

MAX_KEYS = 20_000  # transfers remembered (keys, moves, early revokes): a bound, should many never end

K = TypeVar("K")
V = TypeVar("V")


class Bounded(Generic[K, V]):
    """A dict that forgets its oldest entries past ``limit``: first put, first forgotten
    (putting a key again keeps its place)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: dict[K, V] = {}

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        while len(self._items) > self.limit:
            del self._items[next(iter(self._items))]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


def pair_problem(registration: wire.Registration, ready: ReadyPrefill) -> str | None:
    """Why this registration must not receive this prefill's KV, or None."""
    if ready.decode_engine_id and registration.decode_engine_id != ready.decode_engine_id:
        return f"registration from {registration.decode_engine_id}, but the scheduler chose {ready.decode_engine_id}"
    if not keys_match(registration.transfer_key, ready.transfer_key):
        return "the registration does not carry the transfer's key"
    if ready.num_tokens and registration.num_tokens != ready.num_tokens:
        return f"registration for {registration.num_tokens} tokens, the prompt has {ready.num_tokens}"
    if not 0 <= registration.first_block < len(ready.block_ids):
        return f"registration starts at block {registration.first_block}, the prompt fills {len(ready.block_ids)}"
    if len(registration.block_ids) != len(ready.block_ids) - registration.first_block:
        return (f"registration names {len(registration.block_ids)} blocks from block {registration.first_block}, "
                f"the prompt fills {len(ready.block_ids)}")
    return None


# ---------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True, slots=True)
class Refuse:
    """A message about one of our transfers from a peer that has no part in it (a
    ``WrongParty`` refusal); the book changed nothing."""

    transfer_id: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    """What a half found on arriving, before it is offered to the rendezvous."""

    prefill: ReadyPrefill | None = None  # a prompt: as its transfer's newest move says
    moved_to: str | None = None  # a registration: the transfer moved to this other decode; do not offer it
    forged: Refuse | None = None  # a revoke that came before either half, forged: undone, refuse it


@dataclasses.dataclass(frozen=True, slots=True)
class Revocation:
    """A Revoke from the transfer's decode, taken: no write starts."""

    answer: str | None  # the Revoked reason to tell decode now; None: the write's own end answers it
    prompt: str | None = None  # the request whose waiting blocks go back
    served: str | None = None  # pull: the request whose blocks held for a READ go back; that READ will not come


@dataclasses.dataclass(frozen=True, slots=True)
class MoveAnswer:
    """What to tell the decode a scheduler moved a transfer to (a ``TransferMoved``)."""

    why_not: str | None = None  # why the transfer stays where it was; None: moved
    dropped: wire.Registration | None = None  # moved: the registration of the decode it left, dropped

    @property
    def moved(self) -> bool:
        return self.why_not is None


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    """Pull: the READ of every decode rank reading our heads came; the blocks held for it go back."""

    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Expired:
    """A waiting half whose lease ran out: its transfer is closed."""

    transfer_id: str
    decode_engine_id: str  # whom to tell ("" if unknown)
    request_id: str | None  # a waiting prompt: its blocks go back


@dataclasses.dataclass(slots=True)
class _Move:
    """Where a transfer goes now that a scheduler moved it, and the keys it had before
    (each move's proves it is the transfer's): a Revoke from another decode with one of
    them comes from a decode it moved away from, and is answered at once."""

    decode_engine_id: str
    transfer_key: str
    earlier_keys: list[str]


class TransferBook:
    def __init__(self, lease_s: float, max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._rendezvous: Rendezvous[wire.Registration, ReadyPrefill] = Rendezvous(
            lease_s, check=pair_problem, clock=clock)
        self._counter = CompletionCounter()  # decode's READ notifications
        self._sent: set[str] = set()  # request ids whose blocks may go back (KV left, or given up)
        self._finished: set[str] = set()  # request ids vLLM reported finished
        self._pushing: set[str] = set()  # request ids whose blocks we hold for a transfer
        self._writing: set[str] = set()  # transfer ids matched, whose WRITE has not ended (or was never posted)
        self._served = ServedReads(lease_s)  # pull: blocks held for decode's READ
        # transfer id -> (its key, our blocks for a pull READ's tag); dropped once the transfer ended
        self._keys: Bounded[str, tuple[str, list[int]]] = Bounded(max_keys)
        # Revokes that came before either half, so could not be checked: checked when one comes.
        self._early_revokes: Bounded[str, wire.Revoke] = Bounded(max_keys)
        self._moves: Bounded[str, _Move] = Bounded(max_keys)  # transfer id -> where a scheduler moved it

    # ---------------------------------------------------------------- prompts

    def prefill_ready(self, ready: ReadyPrefill) -> Arrival:
        ready = self._moved(ready)
        self._pushing.add(ready.request_id)
        self._keys.put(ready.transfer_id, (ready.transfer_key, ready.block_ids if ready.mode == "pull" else []))
        revoke = self._early_revokes.pop(ready.transfer_id)
        if revoke is not None and (not keys_match(revoke.transfer_key, ready.transfer_key) or (
                ready.decode_engine_id and revoke.decode_engine_id != ready.decode_engine_id)):
            return Arrival(prefill=ready, forged=self._undo(revoke))
        return Arrival(prefill=ready)

    def serve(self, ready: ReadyPrefill) -> None:
        self._served.hold(ready.transfer_id, ready.request_id, self._clock())

    def offer_prefill(self, ready: ReadyPrefill) -> Match | Refused | None:
        return self._marked(self._rendezvous.offer_prefill(ready.transfer_id, ready))

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        self._finished |= finished_req_ids & self._pushing
        sending = self._finished & self._sent
        self._finished -= sending
        self._sent -= sending
        self._pushing -= sending
        return sending

    def busy(self) -> bool:
        """Blocks are held for a transfer that has not ended."""
        return bool(self._pushing)

    def registration_waiting(self, transfer_id: str) -> bool:
        """Push: decode's registration for this transfer waits for the prompt."""
        half = self._rendezvous.peek(transfer_id)
        return half is not None and half.registration is not None

    def waiting(self, transfer_id: str) -> bool:
        """A half of this push transfer (registration or prompt) waits for the other."""
        return self._rendezvous.peek(transfer_id) is not None

    # ---------------------------------------------------------------- decode's messages

    def registration_arrived(self, registration: wire.Registration) -> Arrival:
        move = self._moves.get(registration.transfer_id)
        if move is not None and registration.decode_engine_id != move.decode_engine_id:
            return Arrival(moved_to=move.decode_engine_id)
        revoke = self._early_revokes.get(registration.transfer_id)
        if revoke is None or revoke.decode_engine_id == registration.decode_engine_id:
            return Arrival()
        self._early_revokes.pop(registration.transfer_id)
        return Arrival(forged=self._undo(revoke))

    def offer_registration(self, registration: wire.Registration) -> Match | Refused | None:
        return self._marked(self._rendezvous.offer_registration(registration.transfer_id, registration))

    def renew(self, transfer_id: str) -> None:
        if not self._rendezvous.renew(transfer_id):
            self._served.renew(transfer_id, self._clock())

    def revoke(self, revoke: wire.Revoke) -> Refuse | Revocation:
        """Decode gives the transfer up. A match is marked writing in the same call as its
        offer: a revoke never finds a match without its write, so is never answered while
        a WRITE can still be posted."""
        if self._moved_away(revoke):
            return Revocation("the transfer moved to another decode; nothing was written to yours")
        problem = self._revoke_problem(revoke)
        if problem is not None:
            return Refuse(revoke.transfer_id, problem)
        half, matched = self._rendezvous.close(revoke.transfer_id, "revoked")
        writing = revoke.transfer_id in self._writing
        served = self._served.release(revoke.transfer_id)
        written = " after it was written" if matched else "; nothing was written"
        return Revocation(None if writing else f"decode gave the transfer up{written}",
                          prompt=half.prefill.request_id if half is not None and half.prefill is not None else None,
                          served=served)

    def move(self, move: wire.MoveTransfer) -> Refuse | MoveAnswer:
        """A scheduler moves a transfer to another decode: its first decode was lost or
        overloaded. Only before its write: once it began, the KV is that decode's."""
        transfer_id = move.transfer_id
        key = self._current_key(transfer_id)
        if key is not None and not keys_match(move.transfer_key, key):
            return Refuse(transfer_id, "a MoveTransfer without the transfer's key")
        if transfer_id in self._writing:
            return MoveAnswer("its write has begun")
        if self._served.holds(transfer_id):
            return MoveAnswer("a pull transfer: the decode chosen after prefill reads it")
        why, dropped = self._rendezvous.retarget(transfer_id, lambda ready: dataclasses.replace(
            ready, decode_engine_id=move.decode_engine_id, transfer_key=move.new_transfer_key))
        if why is not None:
            return MoveAnswer(why)
        earlier = self._moves.pop(transfer_id)
        keys = [*(earlier.earlier_keys if earlier is not None else []), move.transfer_key]
        self._moves.put(transfer_id, _Move(move.decode_engine_id, move.new_transfer_key, keys))
        known = self._keys.get(transfer_id)
        if known is not None:
            self._keys.put(transfer_id, (move.new_transfer_key, known[1]))
        return MoveAnswer(dropped=dropped)

    # ---------------------------------------------------------------- the transfer thread

    def serves(self, transfer_id: str) -> bool:
        """Pull: decode is to READ this transfer's blocks from us."""
        return self._served.holds(transfer_id)

    def read_notified(self, note: Notification) -> Refuse | Release | None:
        """Decode's READ notification: counts only with the transfer's tag over our blocks;
        once every decode rank reading our heads notified (each notification names how
        many they are: ``tp_map``), the blocks held for it go back (``Release``)."""
        transfer_id = note.transfer_id
        key, block_ids = self._keys.get(transfer_id, ("", []))
        if not tag_matches(note.tag, key, block_ids):
            return Refuse(transfer_id, "a READ notification without the transfer's tag over our blocks")
        try:
            if not self._counter.record(transfer_id, note.rank, note.num_ranks):
                return None
        except ValueError as exc:
            return Refuse(transfer_id, f"a READ notification that does not add up: {exc}")
        self._counter.take_done([transfer_id])  # leaves a tombstone against late duplicates
        request_id = self._served.release(transfer_id)
        self._keys.pop(transfer_id)
        return Release(request_id) if request_id is not None else None

    def write_ended(self, transfer_id: str, request_id: str, ok: bool) -> None:
        """The WRITE ended (not stuck): the prompt's blocks go back; a later Revoke finds
        the transfer matched, and is answered. A failed one closes the transfer."""
        self._sent.add(request_id)
        self._writing.discard(transfer_id)
        self._keys.pop(transfer_id)
        if not ok:
            self._rendezvous.close(transfer_id, "failed")

    def write_not_posted(self, transfer_id: str, request_id: str) -> None:
        """A match whose WRITE was never posted: closed (a copy of the registration sent
        again gets the answer), and with nothing in flight its blocks go back."""
        self._rendezvous.close(transfer_id, "failed")
        self._writing.discard(transfer_id)
        self._sent.add(request_id)

    def give_back(self, request_id: str) -> None:
        """A prefill's blocks hold nothing decode will take: they may go back."""
        self._sent.add(request_id)

    # ---------------------------------------------------------------- the lease clock

    def expired(self) -> list[Expired]:
        gone = []
        for transfer_id, half in self._rendezvous.expired():
            ready = half.prefill
            decode_engine_id = half.registration.decode_engine_id if half.registration else (
                ready.decode_engine_id if ready else "")
            gone.append(Expired(transfer_id, decode_engine_id, ready.request_id if ready is not None else None))
        return gone

    def lapsed_reads(self, now: float) -> list[tuple[str, str]]:
        return self._served.lapsed(now)

    # ---------------------------------------------------------------- inside

    def _marked(self, outcome: Match | Refused | None) -> Match | Refused | None:
        if isinstance(outcome, Match):
            self._writing.add(outcome.transfer_id)
        return outcome

    def _moved(self, ready: ReadyPrefill) -> ReadyPrefill:
        """The prefill as the newest move of its transfer says."""
        move = self._moves.get(ready.transfer_id)
        if move is None or ready.mode != "push":
            return ready
        return dataclasses.replace(ready, decode_engine_id=move.decode_engine_id, transfer_key=move.transfer_key)

    def _current_key(self, transfer_id: str) -> str | None:
        """The transfer's key now, if a half or an earlier move shows it."""
        move = self._moves.get(transfer_id)
        if move is not None:
            return move.transfer_key
        half = self._rendezvous.peek(transfer_id)
        if half is not None and half.prefill is not None:
            return half.prefill.transfer_key
        if half is not None and half.registration is not None:
            return half.registration.transfer_key
        return None

    def _moved_away(self, revoke: wire.Revoke) -> bool:
        """A Revoke from a decode this transfer was moved away from, with the key it had:
        no write of ours goes to it, so it is answered now."""
        move = self._moves.get(revoke.transfer_id)
        if move is None or revoke.decode_engine_id == move.decode_engine_id:
            return False
        return any(keys_match(revoke.transfer_key, key) for key in move.earlier_keys)

    def _revoke_problem(self, revoke: wire.Revoke) -> str | None:
        """Why this revoke is not from the transfer's decode, or None."""
        known = self._keys.get(revoke.transfer_id)
        if known is not None:
            if not keys_match(revoke.transfer_key, known[0]):
                return "a Revoke without the transfer's key"
            return None
        half = self._rendezvous.peek(revoke.transfer_id)
        if half is not None and half.registration is not None:
            registration = half.registration
            if (registration.decode_engine_id != revoke.decode_engine_id
                    or not keys_match(revoke.transfer_key, registration.transfer_key)):
                return f"a Revoke from {revoke.decode_engine_id} for a registration of {registration.decode_engine_id}"
        elif half is None:
            # Nothing to check it against yet: it closes the transfer (a registration that
            # comes late must not be written to), and is checked once a half comes.
            self._early_revokes.put(revoke.transfer_id, revoke)
        return None

    def _undo(self, revoke: wire.Revoke) -> Refuse:
        """A revoke that came before either half proved forged once one came: undo it."""
        self._rendezvous.reopen(revoke.transfer_id)
        return Refuse(revoke.transfer_id, f"a Revoke from {revoke.decode_engine_id} without the transfer's key")
