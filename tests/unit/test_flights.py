"""The scheduler's requests in flight: attempts, and what a deadline or a lost worker means
for each; and WorkerPool.is_live, which tells a live start of a worker from a dead one."""

from __future__ import annotations

from kvpush.services.scheduler.flights import Flight, FlightState, FlightTable, Operation, new_transfer_key
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.validation import ValidRequest
from kvpush.shared import wire


def _flight(request_id: str = "r", deadline: float = 100.0, mode: str = "push") -> Flight:
    request = ValidRequest(request_id, [1, 2, 3], wire.SamplingSpec(4, 0.0, False))
    return Flight(request, reply_to="_INBOX.x", received_at=0.0, deadline=deadline, mode=mode)


def _beat(worker_id: str, role: str = "prefill", incarnation: str = "inc-1") -> wire.WorkerHeartbeat:
    return wire.WorkerHeartbeat(
        worker_id=worker_id, role=role, free_kv_blocks=10, total_kv_blocks=10, running=0, waiting=0,
        block_size=16, max_model_len=256, incarnation=incarnation,
    )


def _all_live(worker_id: str, incarnation: str) -> bool:
    return True


def _dead(*dead: str):
    return lambda worker_id, incarnation: worker_id not in dead


_REACH = {  # how a flight gets to each state: what its scheduler hears
    FlightState.DISPATCHING: (),
    FlightState.DISPATCHED: (Flight.jobs_taken,),
    FlightState.KV_WRITTEN: (Flight.jobs_taken, Flight.kv_written),
    FlightState.STREAMING: (Flight.jobs_taken, Flight.streaming_started),
}


def _placed(table: FlightTable, mode: str = "push", state: FlightState = FlightState.DISPATCHING,
            decode: bool = True, moves: int = 0, moving: bool = False) -> Flight:
    flight = _flight(mode=mode)
    table.add(flight)
    table.bind(flight, "t1")
    flight.assign_prefill(_beat("p", "prefill", "inc-p"))
    if decode:
        flight.assign_decode(_beat("d", "decode", "inc-d"))
    for step in _REACH[state]:
        step(flight)
    for _ in range(moves):
        flight.move_declined()
    if moving:
        flight.begin(Operation.RETARGET)
    return flight


def _verdicts(table: FlightTable, now: float, is_live) -> list[tuple[str, str, str]]:
    return [(f.request_id, verdict, worker) for f, verdict, worker in table.check(now, is_live)]


# ------------------------------------------------------------------ the table


def test_add_refuses_a_request_id_already_in_flight():
    table = FlightTable()
    first, second = _flight("r"), _flight("r")
    assert table.add(first) is True
    assert table.add(second) is False
    assert table.by_request("", "r") is first
    assert len(table) == 1


def test_bind_starts_a_new_attempt_and_maps_only_its_transfer_id():
    table = FlightTable()
    flight = _flight()
    table.add(flight)
    table.bind(flight, "t1")
    flight.assign_prefill(_beat("p"))
    flight.kv_written()
    flight.streaming_started()
    flight.move_declined()
    flight.begin(Operation.RETARGET)
    table.bind(flight, "t2")
    assert (flight.attempt, flight.transfer_id) == (2, "t2")
    assert (flight.prefill_id, flight.state, flight.streaming) == ("", FlightState.DISPATCHING, False)
    assert (flight.moves, flight.operation) == (0, Operation.NONE)
    assert table.by_transfer("t2") is flight
    assert table.by_transfer("t1") is None


def test_remove_forgets_the_flight_once():
    table = FlightTable()
    flight = _flight()
    table.add(flight)
    table.bind(flight, "t1")
    assert table.remove(flight) is True
    assert table.remove(flight) is False
    assert (table.by_request("", "r"), table.by_transfer("t1"), len(table)) == (None, None, 0)


def test_remove_of_a_replaced_flight_keeps_the_new_one():
    table = FlightTable()
    old = _flight("r")
    table.add(old)
    table.remove(old)
    new = _flight("r")
    table.add(new)
    assert table.remove(old) is False
    assert table.by_request("", "r") is new


# ------------------------------------------------------------------ check


def test_a_flight_past_its_deadline_gets_the_deadline_verdict():
    table = FlightTable()
    _placed(table)
    assert _verdicts(table, 99.9, _all_live) == []
    assert _verdicts(table, 100.0, _dead("p", "d")) == [("r", "deadline", "")]


def test_live_workers_give_no_verdict():
    table = FlightTable()
    _placed(table)
    assert _verdicts(table, 1.0, _all_live) == []


def test_decode_lost_before_streaming_is_retried():
    table = FlightTable()
    _placed(table)
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "retry", "d")]


def test_decode_lost_after_streaming_is_migrated():
    table = FlightTable()
    _placed(table, state=FlightState.STREAMING)
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "migrate", "d")]


def test_decode_lost_after_streaming_past_max_migrations_is_lost():
    table = FlightTable(max_migrations=1)
    flight = _placed(table, state=FlightState.STREAMING)
    flight.tokens_sent(0, 0, [7, 8], now_wall=10.0, now=0.5)
    flight.migrate()
    table.bind(flight, "t2")
    flight.assign_decode(_beat("d", "decode", "inc-d"))
    flight.tokens_sent(1, 0, [9], now_wall=11.0, now=0.6)
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "lost", "d")]


def test_a_taken_over_flight_migrates_only_once_its_record_is_proven_whole():
    """After a takeover the new holder knows the tokens up to the record's resume point; a
    chunk record right after it proves nothing is missing, a later one does not."""
    table = FlightTable()
    flight = _placed(table, state=FlightState.STREAMING)
    flight.tokens_sent(0, 0, [7], now_wall=10.0, now=0.5)
    flight.migrate()
    record = flight.record("s", "i", now_wall=20.0, now=1.0)
    for first_seq, migratable in ((1, True), (2, False)):
        taken = Flight.from_record(record, revision=3, now_wall=20.0, now=1.0)
        assert taken.why_not_migrate(2) is not None  # not known until a record says
        taken.tokens_sent(first_seq, 0, [9], now_wall=21.0, now=1.1)
        assert (taken.why_not_migrate(2) is None) == migratable
        if migratable:
            assert taken.sent.tokens == [7, 9] and taken.sent.chunks == 2


def test_the_record_of_what_was_sent_feeds_the_resume_point():
    table = FlightTable()
    flight = _placed(table, state=FlightState.DISPATCHED)
    flight.tokens_sent(0, 0, [7, 8], now_wall=10.0, now=0.5)
    flight.tokens_sent(0, 0, [7, 8], now_wall=10.0, now=0.5)  # said twice: kept once
    flight.tokens_sent(1, 0, [9], now_wall=10.1, now=0.6)
    assert flight.streaming
    resume = flight.migrate()
    assert (resume.token_ids, resume.chunks, resume.first_token_at, resume.continuation, resume.migrations) == \
        ([7, 8, 9], 2, 10.0, "reprefill", 1)
    assert flight.attempt_prompt == [1, 2, 3, 7, 8, 9]  # greedy: the tokens sent are prompt now
    table.bind(flight, "t2")
    assert not flight.streaming and flight.migrations == 1 and flight.attempt == 2


def test_a_streaming_decode_without_a_token_for_stall_s_is_stalled():
    table = FlightTable(stall_s=5.0)
    flight = _placed(table, state=FlightState.DISPATCHED)
    flight.tokens_sent(0, 0, [7], now_wall=10.0, now=1.0)
    assert _verdicts(table, 5.9, _all_live) == []
    assert _verdicts(table, 6.1, _all_live) == [("r", "stalled", "d")]
    flight.begin(Operation.MIGRATE)
    assert _verdicts(table, 6.1, _all_live) == []  # being migrated: no second verdict
    assert _verdicts(FlightTable(stall_s=0.0), 60.0, _all_live) == []  # 0: never


def test_prefill_lost_before_the_kv_was_pushed_is_retried():
    table = FlightTable()
    _placed(table)
    assert _verdicts(table, 1.0, _dead("p")) == [("r", "retry", "p")]


def test_prefill_lost_after_the_kv_was_pushed_does_not_matter():
    table = FlightTable()
    _placed(table, state=FlightState.KV_WRITTEN)
    assert _verdicts(table, 1.0, _dead("p")) == []


def test_prefill_lost_after_decode_took_a_pull_job_does_not_matter():
    table = FlightTable()
    _placed(table, mode="pull", state=FlightState.DISPATCHED)
    assert _verdicts(table, 1.0, _dead("p")) == []


def test_prefill_lost_after_decode_took_a_push_job_is_retried():
    table = FlightTable()
    _placed(table, state=FlightState.DISPATCHED)
    assert _verdicts(table, 1.0, _dead("p")) == [("r", "retry", "p")]


def test_pull_prefill_lost_before_decode_was_chosen_is_retried():
    table = FlightTable()
    _placed(table, mode="pull", decode=False)
    assert _verdicts(table, 1.0, _dead("p")) == [("r", "retry", "p")]


def test_a_lost_decode_is_reported_before_a_lost_prefill():
    table = FlightTable()
    _placed(table)
    assert _verdicts(table, 1.0, _dead("p", "d")) == [("r", "retry", "d")]


def test_a_lost_worker_on_the_last_attempt_is_lost():
    table = FlightTable(max_attempts=2)
    flight = _placed(table)
    table.bind(flight, "t2")
    flight.assign_prefill(_beat("p"))
    flight.assign_decode(_beat("d", "decode"))
    assert flight.attempt == 2
    assert _verdicts(table, 1.0, _dead("p")) == [("r", "lost", "p")]


def test_unchosen_workers_are_not_checked():
    table = FlightTable()
    flight = _flight()
    table.add(flight)
    table.bind(flight, "t1")
    assert _verdicts(table, 1.0, _dead("")) == []


def test_a_restarted_worker_counts_as_lost():
    pool = WorkerPool(stale_after_s=5.0)
    pool.observe(_beat("p", "prefill", "inc-p"), now=0.0)
    pool.observe(_beat("d", "decode", "inc-d"), now=0.0)
    table = FlightTable()
    _placed(table)

    def is_live(worker_id: str, incarnation: str) -> bool:
        return pool.is_live(worker_id, incarnation, now)

    now = 1.0
    assert _verdicts(table, now, is_live) == []
    pool.observe(_beat("d", "decode", "inc-d2"), now=2.0)  # same id, a new start
    now = 2.0
    assert _verdicts(table, now, is_live) == [("r", "retry", "d")]


def test_each_flight_gets_its_own_verdict():
    table = FlightTable()
    late = _flight("late", deadline=1.0)
    table.add(late)
    table.bind(late, "t-late")
    on_dead = _flight("on-dead")
    table.add(on_dead)
    table.bind(on_dead, "t-dead")
    on_dead.assign_decode(_beat("dead", "decode"))
    fine = _flight("fine")
    table.add(fine)
    table.bind(fine, "t-fine")
    fine.assign_decode(_beat("ok", "decode"))
    assert sorted(_verdicts(table, 2.0, _dead("dead"))) == [
        ("late", "deadline", ""), ("on-dead", "retry", "dead")]


# ------------------------------------------------------------------ WorkerPool.is_live


def test_is_live_while_the_heartbeats_are_fresh():
    pool = WorkerPool(stale_after_s=5.0)
    pool.observe(_beat("w", incarnation="a"), now=10.0)
    assert pool.is_live("w", "a", now=15.0) is True


def test_is_live_is_false_once_stale():
    pool = WorkerPool(stale_after_s=5.0)
    pool.observe(_beat("w", incarnation="a"), now=10.0)
    assert pool.is_live("w", "a", now=15.1) is False


def test_is_live_is_false_for_another_incarnation():
    pool = WorkerPool(stale_after_s=5.0)
    pool.observe(_beat("w", incarnation="b"), now=10.0)
    assert pool.is_live("w", "a", now=10.0) is False
    assert pool.is_live("w", "b", now=10.0) is True


def test_is_live_is_false_for_an_unknown_or_forgotten_worker():
    pool = WorkerPool(stale_after_s=5.0)
    pool.observe(_beat("w", incarnation="a"), now=10.0)
    pool.forget("w")
    assert (pool.is_live("w", "a", now=10.0), pool.is_live("x", "", now=10.0)) == (False, False)


def test_a_cancel_before_its_request_is_kept_until_the_deadline_and_taken_once():
    from kvpush.services.scheduler.intake import EarlyCancels

    cancels = EarlyCancels(keep_s=10.0)
    cancels.remember("app", "r-1", now=0.0)
    assert not cancels.take("other-client", "r-1", now=1.0)  # only its owner's request
    assert cancels.take("app", "r-1", now=1.0)
    assert not cancels.take("app", "r-1", now=1.0)  # once
    cancels.remember("app", "r-2", now=0.0)
    assert not cancels.take("app", "r-2", now=10.5)  # past the deadline the request could have had


def test_early_cancels_are_bounded_and_expire():
    from kvpush.services.scheduler.intake import EarlyCancels

    cancels = EarlyCancels(keep_s=10.0, max_entries=3)
    for i in range(10):  # a flood of unknown ids
        cancels.remember("", f"r-{i}", now=float(i) * 0.1)
    assert len(cancels) == 3 and cancels.take("", "r-9", now=1.0)
    cancels.remember("", "late", now=100.0)  # everything older has expired
    assert len(cancels) == 1


# ------------------------------------------------------------------ moves


def test_a_push_decode_lost_before_its_kv_was_written_is_moved_not_retried():
    table = FlightTable(max_attempts=1)  # a move computes nothing again: it needs no attempt left
    _placed(table, state=FlightState.DISPATCHED)
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "move", "d")]


def test_no_move_once_the_kv_was_written_or_the_answer_started_or_in_pull():
    for state in (FlightState.KV_WRITTEN, FlightState.STREAMING):
        table = FlightTable()
        _placed(table, state=state)
        assert _verdicts(table, 1.0, _dead("d"))[0][1] != "move", state
    table = FlightTable()
    _placed(table, mode="pull", state=FlightState.DISPATCHED)
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "retry", "d")]


def test_no_move_when_the_prefill_is_lost_too_or_after_max_moves():
    table = FlightTable()
    _placed(table, state=FlightState.DISPATCHED)
    assert _verdicts(table, 1.0, _dead("p", "d")) == [("r", "retry", "d")]
    table = FlightTable()
    _placed(table, state=FlightState.DISPATCHED, moves=2)
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "retry", "d")]


def test_a_transfer_never_moves_back_to_a_decode_it_left():
    """Seen in the 2P2D multi-turn bench: moved d -> d2 (d overloaded), then d2 overloaded
    and d idle, moved back to d; but d had been told to drop that transfer, dropped the job
    that came again for it, and the request waited for its deadline. The decodes an
    attempt left are out of the pick; a new attempt starts afresh."""
    import pytest

    from kvpush.shared.errors import NoWorkers

    table = FlightTable()
    flight = _placed(table, state=FlightState.DISPATCHED)
    flight.moved("d2", "inc-d2", "key-2")
    assert (flight.decode_id, flight.left_decodes) == ("d2", {"d"})
    pool = WorkerPool(stale_after_s=5.0)
    for worker in ("d", "d2"):
        pool.observe(_beat(worker, "decode", f"inc-{worker}"), 0.0)
    with pytest.raises(NoWorkers):  # d2 is overloaded now: the only other decode is d, which it left
        pool.pick_decode(3, 1.0, exclude=flight.left_decodes | {"d2"})
    assert pool.pick_decode(3, 1.0, exclude={"d2"}).worker_id == "d"  # without the memory: back to d
    flight.new_attempt("t2")
    assert flight.left_decodes == set()


def test_a_flight_being_moved_gets_no_verdict_but_its_deadline():
    table = FlightTable()
    _placed(table, state=FlightState.DISPATCHED, moving=True)
    assert _verdicts(table, 1.0, _dead("d")) == []
    assert _verdicts(table, 100.0, _dead("d")) == [("r", "deadline", "")]


def test_a_push_transfer_not_yet_written_to_an_overloaded_decode_is_moved():
    table = FlightTable()
    _placed(table, state=FlightState.DISPATCHED)
    assert _verdicts(table, 1.0, _all_live) == []
    moved = [(f.request_id, v, w) for f, v, w in table.check(1.0, _all_live, lambda decode_id: decode_id == "d")]
    assert moved == [("r", "move", "d")]
    table = FlightTable()
    _placed(table, state=FlightState.KV_WRITTEN)  # written: it stays
    assert table.check(1.0, _all_live, lambda decode_id: True) == []


def test_a_settled_move_is_checked_again_and_a_declined_one_counts_as_a_move():
    table = FlightTable()
    flight = _placed(table, state=FlightState.DISPATCHED, moving=True)
    flight.end(Operation.RETARGET)
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "move", "d")]
    flight.move_declined()
    flight.move_declined()
    assert _verdicts(table, 1.0, _dead("d")) == [("r", "retry", "d")]  # MAX_MOVES asked


def test_a_moved_transfer_has_its_new_decode_and_secret():
    table = FlightTable()
    flight = _placed(table, state=FlightState.DISPATCHED)
    flight.moved("d-2", "inc-d2", "new-key")
    assert (flight.decode_id, flight.decode_incarnation, flight.transfer_key, flight.moves) == (
        "d-2", "inc-d2", "new-key", 1)
    assert flight.state is FlightState.DISPATCHED


# ------------------------------------------------------------------ FlightState


def test_the_state_only_moves_forward_within_an_attempt():
    flight = _flight()
    flight.streaming_started()  # the first token came before the job's ack was read
    flight.jobs_taken()
    flight.kv_written()
    assert (flight.state, flight.streaming) == (FlightState.STREAMING, True)
    flight.new_attempt("t2")
    assert (flight.state, flight.streaming) == (FlightState.DISPATCHING, False)


def test_a_pull_flight_needs_its_prefill_until_decode_takes_the_job():
    flight = _flight(mode="pull")
    assert flight.needs_prefill()
    flight.jobs_taken()
    assert not flight.needs_prefill()


def test_the_workers_chosen_are_those_starts_and_released_together():
    flight = _flight()
    flight.assign_prefill(_beat("p", "prefill", "inc-p"))
    flight.assign_decode(_beat("d", "decode", "inc-d"))
    assert (flight.prefill_id, flight.prefill_incarnation, flight.decode_id, flight.decode_incarnation) == (
        "p", "inc-p", "d", "inc-d")
    flight.release_workers()
    assert (flight.prefill_id, flight.prefill_incarnation, flight.decode_id, flight.decode_incarnation) == (
        "", "", "", "")


# ------------------------------------------------------------------ Operation


def test_one_operation_at_a_time_and_a_new_attempt_starts_with_none():
    flight = _flight()
    assert flight.operation is Operation.NONE and not flight.busy
    assert flight.begin(Operation.RETRY) is True
    assert flight.begin(Operation.RETRY) is False  # asked again: the first one goes on
    assert flight.begin(Operation.MIGRATE) is False and flight.operation is Operation.RETRY
    flight.end(Operation.MIGRATE)  # not the one under way: nothing ends
    assert flight.operation is Operation.RETRY and flight.busy
    flight.end(Operation.RETRY)
    assert flight.begin(Operation.MIGRATE) is True
    flight.new_attempt("t2")
    assert flight.operation is Operation.NONE
    assert flight.begin(Operation.RETARGET) is True


def test_each_busy_operation_holds_every_verdict_but_the_deadline():
    for operation in (Operation.RETARGET, Operation.MIGRATE, Operation.RETRY):
        table = FlightTable()
        flight = _placed(table, state=FlightState.DISPATCHED)
        assert flight.begin(operation)
        assert _verdicts(table, 1.0, _dead("d")) == []
        assert _verdicts(table, 100.0, _dead("d")) == [("r", "deadline", "")]
        flight.end(operation)
        assert _verdicts(table, 1.0, _dead("d")) == [("r", "move", "d")]  # checked again once it ended


def test_migrating_ends_the_migrate_operation():
    table = FlightTable()
    flight = _placed(table, state=FlightState.DISPATCHED)
    flight.tokens_sent(0, 0, [7], now_wall=10.0, now=0.5)
    assert flight.begin(Operation.MIGRATE)
    flight.migrate()
    assert flight.operation is Operation.NONE


def test_every_transfer_key_is_a_fresh_secret():
    keys = {new_transfer_key() for _ in range(100)} | {_flight().transfer_key for _ in range(100)}
    assert len(keys) == 200 and all(len(key) == 32 and int(key, 16) >= 0 for key in keys)
    flight = _flight()
    first = flight.transfer_key
    flight.new_attempt("t2")
    assert flight.transfer_key != first
