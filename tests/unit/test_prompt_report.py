"""What the engine that computed a prompt says of it (its prefix-cache hits, its prompt
logprobs) on its way to the decode that answers: in the job in pull, passed on by the
scheduler in push (``dispatch.prompt_ready``), and waited for by decode only as long as
it needs (``RunningJob.prompt_report``)."""

from __future__ import annotations

import asyncio

from kvpush.services.scheduler import dispatch
from kvpush.services.scheduler.flights import Flight
from kvpush.services.scheduler.validation import ValidRequest
from kvpush.services.worker.job_book import JobBook
from kvpush.services.worker.jobs import RunningJob
from kvpush.shared import wire

REPORT = wire.PromptReport(cached_tokens=16, logprobs=[None, [wire.TokenLogprob(5, -1.5, 1, "b")]])


def _flight(mode: str, prompt_logprobs: int | None = None) -> Flight:
    request = ValidRequest("r", [9, 5], wire.SamplingSpec(4, 0.0, False, prompt_logprobs=prompt_logprobs))
    flight = Flight(request, reply_to="_INBOX.x", received_at=0.0, deadline=100.0, mode=mode)
    flight.transfer_id, flight.prefill_id, flight.decode_id = "t1", "prefill-0", "decode-0" if mode == "push" else ""
    return flight


def _handoff(prompt: wire.PromptReport | None = REPORT) -> wire.Handoff:
    return wire.Handoff(request_id="r", transfer_id="t1", prefill_engine_id="prefill-0", first_token_id=3,
                        prefill_started_at=0.0, prefill_finished_at=1.0, prompt=prompt)


def test_prefill_is_asked_for_the_requests_prompt_logprobs():
    assert dispatch.prefill_job(_flight("push", prompt_logprobs=2)).prompt_logprobs == 2
    assert dispatch.prefill_job(_flight("pull")).prompt_logprobs is None


def test_push_passes_prefills_report_to_the_decode_already_generating():
    ready = dispatch.prompt_ready(_flight("push"), _handoff())
    assert ready == wire.PromptReady(request_id="r", transfer_id="t1", prompt=REPORT)
    assert wire.decode(wire.encode(ready), wire.DecodeMessage) == ready  # on decode's job subject
    assert dispatch.prompt_ready(_flight("push"), _handoff(prompt=None)) is None  # prefill said nothing
    # Pull: decode is chosen after prefill, so the report rides its job instead.
    assert dispatch.prompt_ready(_flight("pull"), _handoff()) is None
    assert dispatch.decode_job(_flight("pull"), {}, REPORT).prompt == REPORT


async def test_decode_waits_for_the_report_only_as_long_as_it_is_told():
    running = RunningJob(dispatch.decode_job(_flight("push"), {}))
    assert await running.prompt_report(0.05) is None  # not here: unknown, not a number
    waiting = asyncio.ensure_future(running.prompt_report(5.0))
    await asyncio.sleep(0)
    running.prompt_arrived(REPORT)
    assert await waiting == REPORT
    running.prompt_arrived(wire.PromptReport(cached_tokens=0))  # a later one (a duplicate) changes nothing
    assert await running.prompt_report(0) == REPORT


def test_a_report_that_beats_its_decode_job_waits_for_it_and_a_cancelled_ones_does_not():
    """The scheduler sends the job and, after prefill's handoff, the report: two messages,
    which may arrive in either order (NATS orders one publisher's messages per subject,
    but the job goes out as a request that may be retried, and a takeover's scheduler is
    another publisher)."""
    book = JobBook(early_memory=2)
    flight = _flight("push")
    book.prompt_ready(wire.PromptReady(request_id="r", transfer_id="t1", prompt=REPORT))  # first
    running = book.arrived(dispatch.decode_job(flight, {}))
    assert running.prompt == REPORT and running.prompt_here.is_set()
    book.ended("t1")
    book.cancelled("t2")
    book.prompt_ready(wire.PromptReady(request_id="r", transfer_id="t2", prompt=REPORT))
    late = dispatch.decode_job(flight, {})
    late.transfer_id = "t2"
    assert book.arrived(late) is None  # cancelled before it came: dropped, report and all
    for i in range(3):  # bounded: the oldest early report is forgotten
        book.prompt_ready(wire.PromptReady(request_id="r", transfer_id=f"x{i}", prompt=REPORT))
    forgotten = dispatch.decode_job(flight, {})
    forgotten.transfer_id = "x0"
    assert book.arrived(forgotten).prompt is None
    pull = book.arrived(dispatch.decode_job(_flight("pull"), {}, REPORT))  # pull: in the job
    assert pull.prompt == REPORT
