"""The prefill side's decisions about its transfers, driven directly: only the transfer's
key and its decode count; a move is honoured before the write only; a revoke frees what
it can and is answered once no write can land; what peers can grow is bounded."""

from __future__ import annotations

import pytest

from kvpush.connector.completion import Notification, block_tag
from kvpush.connector.metadata import ReadyPrefill
from kvpush.connector.rendezvous import Match, Refused
from kvpush.connector.transfer_book import Bounded, Expired, MoveAnswer, Refuse, Release, Revocation, TransferBook
from kvpush.shared import wire

KEY, NEW_KEY, WRONG_KEY = "k" * 32, "n" * 32, "w" * 32
DECODE, OTHER = "decode-a", "decode-b"


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _book(**kwargs) -> tuple[TransferBook, FakeClock]:
    clock = FakeClock()
    return TransferBook(lease_s=5.0, clock=clock, **kwargs), clock


def _ready(transfer_id: str = "t", mode: str = "push", key: str = KEY, decode: str = DECODE,
           request_id: str = "prompt") -> ReadyPrefill:
    return ReadyPrefill(request_id, transfer_id, [0, 1, 2], mode=mode, num_tokens=12,
                        decode_engine_id=decode if mode == "push" else "", transfer_key=key)


def _registration(transfer_id: str = "t", key: str = KEY, decode: str = DECODE) -> wire.Registration:
    return wire.Registration(transfer_id=transfer_id, request_id="r", decode_engine_id=decode,
                             decode_request_id="d", decode_tp_size=1, block_ids=[7, 8, 9], num_tokens=12,
                             registered_at=0.0, transfer_key=key)


def _revoke(transfer_id: str = "t", key: str = KEY, decode: str = DECODE) -> wire.Revoke:
    return wire.Revoke(transfer_id=transfer_id, decode_engine_id=decode, reason="test", transfer_key=key)


def _move(transfer_id: str = "t", key: str = KEY, to: str = OTHER, new_key: str = NEW_KEY) -> wire.MoveTransfer:
    return wire.MoveTransfer(transfer_id=transfer_id, scheduler_id="s", transfer_key=key, decode_engine_id=to,
                             new_transfer_key=new_key)


def _waiting_prompt(book: TransferBook, ready: ReadyPrefill | None = None) -> ReadyPrefill:
    ready = book.prefill_ready(ready or _ready()).prefill
    assert book.offer_prefill(ready) is None
    return ready


def _matched(book: TransferBook) -> Match:
    _waiting_prompt(book)
    match = book.offer_registration(_registration())
    assert isinstance(match, Match)
    return match


def _read(transfer_id: str = "t", key: str = KEY, blocks=(0, 1, 2), rank: int = 0, ranks: int = 1) -> Notification:
    return Notification(transfer_id, rank, ranks, block_tag(key, list(blocks)))


# ------------------------------------------------------------------ the transfer's key


def test_a_registration_without_the_key_is_refused_and_the_prompt_waits_for_the_right_one():
    book, _ = _book()
    _waiting_prompt(book)
    refused = book.offer_registration(_registration(key=WRONG_KEY))
    assert isinstance(refused, Refused)
    assert (refused.code, refused.reason) == ("incompatible", "the registration does not carry the transfer's key")
    assert book.waiting("t")
    assert isinstance(book.offer_registration(_registration()), Match)


def test_a_registration_from_a_decode_the_scheduler_did_not_choose_is_refused():
    book, _ = _book()
    _waiting_prompt(book)
    refused = book.offer_registration(_registration(decode=OTHER))
    assert refused.code == "incompatible" and OTHER in refused.reason and DECODE in refused.reason


def test_a_revoke_without_the_key_is_refused_and_closes_nothing():
    book, _ = _book()
    _waiting_prompt(book)
    for key in ("", WRONG_KEY):
        assert book.revoke(_revoke(key=key)) == Refuse("t", "a Revoke without the transfer's key")
    assert book.waiting("t")
    assert isinstance(book.offer_registration(_registration()), Match)


def test_a_revoke_from_another_decode_than_the_waiting_registrations_is_refused():
    book, _ = _book()
    assert book.offer_registration(_registration()) is None
    refused = book.revoke(_revoke(decode=OTHER))
    assert refused == Refuse("t", f"a Revoke from {OTHER} for a registration of {DECODE}")
    assert book.waiting("t")


def test_a_move_without_the_key_is_refused_and_moves_nothing():
    book, _ = _book()
    _waiting_prompt(book)
    assert book.move(_move(key=WRONG_KEY)) == Refuse("t", "a MoveTransfer without the transfer's key")
    assert isinstance(book.offer_registration(_registration()), Match)  # still the first decode's


def test_a_read_counts_only_with_the_keys_tag_over_our_blocks_and_releases_once():
    book, _ = _book()
    ready = book.prefill_ready(_ready(mode="pull")).prefill
    book.serve(ready)
    for note in (_read(key=WRONG_KEY), _read(blocks=(1, 2, 3)), Notification("t", 0, 1, "")):
        assert book.read_notified(note) == Refuse("t", "a READ notification without the transfer's tag over our blocks")
    assert book.serves("t")
    assert book.read_notified(_read(rank=0, ranks=2)) is None  # one rank of two
    assert book.serves("t")
    assert book.read_notified(_read(rank=1, ranks=2)) == Release("prompt")
    assert not book.serves("t")
    assert isinstance(book.read_notified(_read(rank=1, ranks=2)), Refuse)  # its key is gone with the transfer


# ------------------------------------------------------------------ moves


def test_a_move_before_the_match_drops_the_first_registration_and_sends_the_prompt_to_the_new_decode():
    book, _ = _book()
    first = _registration()
    assert book.offer_registration(first) is None
    assert book.move(_move()) == MoveAnswer(dropped=first)
    assert not book.waiting("t")

    assert book.registration_arrived(_registration()).moved_to == OTHER  # the first decode's, sent again
    arrival = book.prefill_ready(_ready())  # the prompt, as its engine knew it
    assert (arrival.prefill.decode_engine_id, arrival.prefill.transfer_key) == (OTHER, NEW_KEY)
    assert book.offer_prefill(arrival.prefill) is None
    assert book.registration_arrived(_registration(key=NEW_KEY, decode=OTHER)).moved_to is None
    match = book.offer_registration(_registration(key=NEW_KEY, decode=OTHER))
    assert isinstance(match, Match) and match.registration.decode_engine_id == OTHER


def test_a_waiting_prompt_is_retargeted_and_a_second_move_needs_the_first_moves_key():
    book, _ = _book()
    _waiting_prompt(book)
    assert book.move(_move()).moved
    assert isinstance(book.move(_move(key=KEY, to=DECODE, new_key="x" * 32)), Refuse)  # the old key no more
    assert isinstance(book.offer_registration(_registration()), Refused)  # the old decode's
    assert isinstance(book.offer_registration(_registration(key=NEW_KEY, decode=OTHER)), Match)


def test_a_move_is_refused_once_the_write_began_even_after_it_ended():
    book, _ = _book()
    match = _matched(book)
    assert book.move(_move()) == MoveAnswer("its write has begun")
    book.write_ended(match.transfer_id, "prompt", ok=True)
    assert book.move(_move()) == MoveAnswer("its write has begun")


def test_a_pull_transfer_is_not_moved():
    book, _ = _book()
    book.serve(book.prefill_ready(_ready(mode="pull")).prefill)
    assert book.move(_move()) == MoveAnswer("a pull transfer: the decode chosen after prefill reads it")


def test_a_move_of_a_closed_transfer_says_so():
    book, _ = _book()
    _waiting_prompt(book)
    book.revoke(_revoke())
    answer = book.move(_move())
    assert answer == MoveAnswer("the transfer is revoked") and not answer.moved


def test_a_revoke_from_the_decode_moved_away_from_is_answered_at_once_and_closes_nothing():
    book, _ = _book()
    _waiting_prompt(book)
    book.move(_move())
    assert book.revoke(_revoke()) == Revocation("the transfer moved to another decode; nothing was written to yours")
    assert isinstance(book.offer_registration(_registration(key=NEW_KEY, decode=OTHER)), Match)


def test_a_revoke_from_the_decode_moved_away_from_without_its_old_key_is_refused():
    book, _ = _book()
    _waiting_prompt(book)
    book.move(_move())
    assert isinstance(book.revoke(_revoke(key=WRONG_KEY)), Refuse)
    assert book.waiting("t")


# ------------------------------------------------------------------ revokes


def test_a_revoke_of_a_waiting_prompt_gives_its_blocks_back_and_closes_the_transfer():
    book, _ = _book()
    _waiting_prompt(book)
    assert book.revoke(_revoke()) == Revocation("decode gave the transfer up; nothing was written", prompt="prompt")
    refused = book.offer_registration(_registration())
    assert (refused.code, refused.reason) == ("closed", "transfer revoked")


def test_a_revoke_during_the_write_is_left_for_the_writes_end_to_answer():
    book, _ = _book()
    _matched(book)
    assert book.revoke(_revoke()) == Revocation(None)


def test_a_revoke_of_a_finished_transfer_is_answered_that_it_was_written():
    book, _ = _book()
    match = _matched(book)
    book.write_ended(match.transfer_id, "prompt", ok=True)
    assert book.revoke(_revoke()) == Revocation("decode gave the transfer up after it was written")


def test_a_revoke_of_an_unknown_transfer_closes_it_and_a_prompt_with_its_key_finds_it_closed():
    book, _ = _book()
    assert book.revoke(_revoke()) == Revocation("decode gave the transfer up; nothing was written")
    arrival = book.prefill_ready(_ready())
    assert arrival.forged is None
    refused = book.offer_prefill(arrival.prefill)
    assert isinstance(refused, Refused) and refused.code == "closed"


def test_an_early_revoke_without_the_key_is_undone_when_the_prompt_comes():
    book, _ = _book()
    book.revoke(_revoke(key=WRONG_KEY))
    arrival = book.prefill_ready(_ready())
    assert arrival.forged == Refuse("t", f"a Revoke from {DECODE} without the transfer's key")
    assert book.offer_prefill(arrival.prefill) is None  # open again: the prompt waits
    assert isinstance(book.offer_registration(_registration()), Match)


def test_an_early_revoke_from_another_decode_than_the_registration_is_undone():
    book, _ = _book()
    book.revoke(_revoke(decode=OTHER))
    arrival = book.registration_arrived(_registration())
    assert arrival.forged == Refuse("t", f"a Revoke from {OTHER} without the transfer's key")
    assert book.offer_registration(_registration()) is None


def test_an_early_revoke_from_the_registrations_own_decode_stands():
    book, _ = _book()
    book.revoke(_revoke())
    assert book.registration_arrived(_registration()).forged is None
    assert book.offer_registration(_registration()).code == "closed"


def test_a_revoke_of_a_pulled_prompt_gives_its_held_blocks_back():
    book, _ = _book()
    book.serve(book.prefill_ready(_ready(mode="pull")).prefill)
    assert book.revoke(_revoke()) == Revocation("decode gave the transfer up; nothing was written", served="prompt")
    assert not book.serves("t")


# ------------------------------------------------------------------ writes and blocks going back


def test_blocks_go_back_once_their_kv_left_and_vllm_finished_the_request():
    book, _ = _book()
    match = _matched(book)
    assert book.busy()
    assert book.finished({"prompt"}) == set()  # finished, the write not ended
    book.write_ended(match.transfer_id, "prompt", ok=True)
    assert book.finished(set()) == {"prompt"}
    assert not book.busy()
    assert book.finished({"prompt"}) == set()  # once


def test_a_write_that_failed_closes_the_transfer():
    book, _ = _book()
    match = _matched(book)
    book.write_ended(match.transfer_id, "prompt", ok=False)
    refused = book.offer_registration(_registration())  # decode's registration, sent again
    assert (refused.code, refused.reason) == ("closed", "transfer failed")
    assert book.finished({"prompt"}) == {"prompt"}


def test_a_write_never_posted_closes_the_transfer_and_gives_the_blocks_back():
    book, _ = _book()
    match = _matched(book)
    book.write_not_posted(match.transfer_id, "prompt")
    assert book.offer_registration(_registration()).code == "closed"
    assert book.revoke(_revoke()) == Revocation("decode gave the transfer up; nothing was written")
    assert book.finished({"prompt"}) == {"prompt"}


def test_a_request_not_held_for_a_transfer_is_not_reported():
    book, _ = _book()
    book.give_back("other")
    assert book.finished({"other"}) == set()


# ------------------------------------------------------------------ leases


def test_a_waiting_half_expires_unless_renewed():
    book, clock = _book()
    _waiting_prompt(book)
    assert book.offer_registration(_registration(transfer_id="r")) is None
    clock.now += 4
    book.renew("t")
    clock.now += 2
    assert book.expired() == [Expired("r", DECODE, None)]
    clock.now += 4
    assert book.expired() == [Expired("t", DECODE, "prompt")]
    assert book.offer_registration(_registration()).reason == "transfer expired"


def test_a_held_read_lapses_unless_renewed():
    book, clock = _book()
    book.serve(book.prefill_ready(_ready(mode="pull")).prefill)
    clock.now += 4
    book.renew("t")
    assert book.lapsed_reads(clock.now + 2) == []
    assert book.lapsed_reads(clock.now + 5) == [("t", "prompt")]
    assert not book.serves("t")


# ------------------------------------------------------------------ bounds


def test_bounded_forgets_the_oldest_first_put():
    memory: Bounded[str, int] = Bounded(2)
    memory.put("a", 1)
    memory.put("b", 2)
    memory.put("a", 3)  # keeps its place
    memory.put("c", 4)
    assert ("a" in memory, memory.get("b"), memory.get("c"), len(memory)) == (False, 2, 4, 2)
    assert memory.pop("b") == 2 and memory.pop("b") is None


def test_past_max_keys_the_oldest_transfers_key_is_forgotten():
    book, _ = _book(max_keys=2)
    for transfer_id in ("a", "b", "c"):
        book.serve(book.prefill_ready(_ready(transfer_id, mode="pull", request_id=transfer_id)).prefill)
    assert isinstance(book.read_notified(_read("a")), Refuse)  # no key to check its tag against
    assert book.read_notified(_read("c")) == Release("c")


@pytest.mark.parametrize("bound, forged", [(2, True), (1, False)])
def test_early_revokes_kept_to_check_are_bounded(bound, forged):
    book, _ = _book(max_keys=bound)
    book.revoke(_revoke("a", key=WRONG_KEY))
    book.revoke(_revoke("b", key=WRONG_KEY))
    assert (book.prefill_ready(_ready("a")).forged is not None) == forged


def test_pull_blocks_go_back_only_after_every_decode_rank_reading_them_notified():
    """Tensor parallelism: two decode ranks read halves of this prefill rank's blocks; each
    READ notification says it is one of two readers. A notification that counts the
    readers otherwise does not count."""
    book, _ = _book()
    ready = _ready(mode="pull")
    book.prefill_ready(ready)
    book.serve(ready)
    tag = block_tag(KEY, [0, 1, 2])
    assert book.read_notified(Notification("t", 1, 2, tag)) is None
    assert isinstance(book.read_notified(Notification("t", 0, 1, tag)), Refuse)
    assert book.read_notified(Notification("t", 0, 2, tag)) == Release("prompt")
