"""Which flights a scheduler takes over (``kvpush.services.scheduler.takeover``), and a flight's
record round trip (``Flight.record`` / ``Flight.from_record``)."""

from __future__ import annotations

from kvpush.services.scheduler.flights import Flight, FlightState
from kvpush.services.scheduler.takeover import Holding, SchedulerLiveness, orphans
from kvpush.services.scheduler.validation import ValidRequest
from kvpush.shared import wire

TIMEOUT = 3.0


def liveness(started_at: float = 0.0) -> SchedulerLiveness:
    return SchedulerLiveness("me", "inc-now", TIMEOUT, started_at=started_at)


def test_a_scheduler_unheard_since_our_start_is_gone_only_after_a_whole_timeout():
    live = liveness(started_at=100.0)
    assert not live.is_gone("other", "i1", 100.0 + TIMEOUT)
    assert live.is_gone("other", "i1", 100.0 + TIMEOUT + 0.1)


def test_a_heard_scheduler_stays_until_a_timeout_passes_without_its_heartbeat():
    live = liveness()
    live.observe("other", "i1", 10.0)
    assert not live.is_gone("other", "i1", 10.0 + TIMEOUT)
    assert live.is_gone("other", "i1", 10.0 + TIMEOUT + 0.1)


def test_a_restarted_scheduler_has_lost_its_earlier_starts_flights_at_once():
    live = liveness()
    live.observe("other", "i2", 10.0)
    assert live.is_gone("other", "i1", 10.0)
    assert not live.is_gone("other", "i2", 10.0)


def test_our_own_earlier_life_is_an_orphan_at_once_and_our_present_one_never():
    live = liveness()
    assert live.is_gone("me", "inc-before", 0.0)
    assert not live.is_gone("me", "inc-now", 1e9)


def test_while_nats_is_down_or_after_our_own_stall_silence_proves_nothing():
    live = liveness()
    live.observe("other", "i1", 10.0)
    live.pause_evidence()
    assert not live.is_gone("other", "i1", 100.0)
    live.resume_evidence(100.0)
    assert not live.is_gone("other", "i1", 100.0 + TIMEOUT)
    assert live.is_gone("other", "i1", 100.0 + TIMEOUT + 0.1)


def test_orphans_are_the_flights_of_gone_schedulers_not_held_here():
    live = liveness()
    live.observe("alive", "a", 10.0)
    live.observe("dead", "d", 0.0)
    holdings = {
        "r1": Holding("alive", "a", 1),
        "r2": Holding("dead", "d", 2),
        "r3": Holding("me", "inc-before", 3),
        "r4": Holding("me", "inc-now", 4),
        "r5": Holding("dead", "d", 5),
    }
    found = orphans(holdings, live, 10.0, held_here={"r5"})
    assert [request_id for request_id, _ in found] == ["r2", "r3"]


def test_the_table_of_heard_schedulers_is_bounded():
    live = SchedulerLiveness("me", "i", TIMEOUT, started_at=0.0, max_schedulers=3)
    for n in range(10):
        live.observe(f"s{n}", "i", float(n))
    assert live.live(9.0) == ["s7", "s8", "s9"]


def test_a_flight_comes_back_from_its_record_where_it_was_with_its_deadline_in_this_clock():
    request = ValidRequest("r1", [1, 2, 3], wire.SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=False), "pull")
    flight = Flight(request, "_INBOX.c.x", received_at=1000.0, deadline=50.0, mode="pull", owner="c",
                    kv_policy="fail")
    flight.place("pull", "auto", "prefill should take 2.00 s: choose decode when it ends")
    flight.new_attempt("t1")
    flight.new_attempt("t2")
    flight.assign_prefill(wire.WorkerHeartbeat(worker_id="p0", role="prefill", free_kv_blocks=1, total_kv_blocks=1,
                                               running=0, waiting=0, block_size=16, max_model_len=64,
                                               incarnation="pi"))
    flight.jobs_taken()
    record = flight.record("s0", "inc", now_wall=2000.0, now=40.0)
    assert record.deadline_at == 2010.0 and record.holder == "s0"
    again = Flight.from_record(wire.decode(wire.encode(record), wire.FlightRecord), 7, now_wall=2004.0, now=500.0)
    assert again.deadline == 506.0 and again.revision == 7
    assert (again.request, again.owner, again.mode, again.attempt, again.transfer_id, again.transfer_key,
            again.prefill_id, again.prefill_incarnation) == (request, "c", "pull", 2, "t2", flight.transfer_key,
                                                             "p0", "pi")
    assert again.state is FlightState.DISPATCHING  # in memory only: the record does not carry it
    # What its path report says: the policy and placement it had, and one takeover more (each adoption counts).
    assert (again.kv_policy, again.mode_chosen_by, again.mode_reason, again.takeovers) == (
        "fail", "auto", "prefill should take 2.00 s: choose decode when it ends", 1)
    twice = Flight.from_record(wire.decode(wire.encode(again.record("s1", "i", 2005.0, 501.0)), wire.FlightRecord),
                               8, now_wall=2006.0, now=9.0)
    assert twice.takeovers == 2
