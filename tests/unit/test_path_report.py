"""The path report decode puts in each final (services/worker/path_report.py), what the
scheduler gives it (services/scheduler/dispatch.py), and how the gateway shows it
(services/gateway/responses.py). The numbers against real engines: tests/stack/test_path_report.py."""

from __future__ import annotations

import msgspec
import pytest

from kvpush.otel.attributes import path_attributes
from kvpush.services.cli.requests import describe_path
from kvpush.services.gateway import requests, responses
from kvpush.services.scheduler import dispatch
from kvpush.services.scheduler.flights import Flight
from kvpush.services.scheduler.placement import PlacementSettings, place
from kvpush.services.scheduler.validation import ValidRequest
from kvpush.services.worker.path_report import DecodeSaw, effective_policy, load_failure_of, path_report, received_of
from kvpush.shared import wire

PROMPT = list(range(100))  # 100 tokens: with 16-token blocks, 7 blocks (the last partly)
SAMPLING = wire.SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=False)


def job(mode: str = "push", route: wire.RouteReport | None = None) -> wire.DecodeJob:
    return wire.DecodeJob(request_id="r", transfer_id="t", prompt_token_ids=PROMPT, sampling=SAMPLING,
                          prefill_engine_id="prefill-0", reply_to="_INBOX.x", received_at=0.0, mode=mode,
                          route=route or wire.RouteReport(chosen_by="auto", reason="prefill should end within 1 s"))


def test_the_strictest_policy_wins():
    assert effective_policy("recompute", "recompute") == "recompute"
    assert effective_policy("fail", "recompute") == "fail"
    assert effective_policy("recompute", "fail") == "fail"  # a decode that may not compute prompts never does


def test_a_transfer_that_arrived_says_what_came_from_where():
    received = wire.ReceivedKv(local_tokens=32, tokens=68, blocks=5, bytes=5 * 4096, checksum="verified")
    report = path_report(job(), "decode-0", DecodeSaw(received=received), "recompute",
                         wire.PromptReport(cached_tokens=16))
    assert (report.mode, report.chosen_by, report.prefill_worker, report.decode_worker) == (
        "push", "auto", "prefill-0", "decode-0")
    assert (report.prompt_tokens, report.prefill_computed_tokens, report.received_tokens, report.received_blocks,
            report.received_bytes, report.decode_cached_tokens, report.decode_computed_tokens,
            report.recomputed_tokens) == (100, 84, 68, 5, 20480, 32, 0, 0)
    assert report.received_tokens + report.decode_cached_tokens + report.decode_computed_tokens == 100
    assert (report.kv_checksum, report.kv_failure) == ("verified", "")


def test_a_transfer_into_decode_at_tp_2_says_what_landed_in_each_rank_and_explain_prints_it():
    parts = [wire.RankKv(rank=0, blocks=5, bytes=5 * 2048), wire.RankKv(rank=1, blocks=5, bytes=5 * 2048)]
    received = wire.ReceivedKv(local_tokens=32, tokens=68, blocks=5, bytes=5 * 4096, by_rank=parts)
    report = path_report(job(), "decode-0", DecodeSaw(received=received), "recompute", None)
    assert report.received_by_rank == parts
    assert sum(part.bytes for part in report.received_by_rank) == report.received_bytes
    assert "  received by rank: rank 0 5 blocks, 10240 bytes; rank 1 5 blocks, 10240 bytes" in (
        describe_path(report).splitlines())
    # At TP 1 the one rank's part is the whole: explain says it once.
    whole = wire.ReceivedKv(local_tokens=0, tokens=68, blocks=5, bytes=5 * 4096,
                            by_rank=[wire.RankKv(rank=0, blocks=5, bytes=5 * 4096)])
    one = path_report(job(), "decode-0", DecodeSaw(received=whole), "recompute", None)
    assert len(one.received_by_rank) == 1 and "by rank" not in describe_path(one)
    # Recomputed after a failed transfer: nothing received, in any rank.
    failed = path_report(job(), "d", DecodeSaw(computed_here=True, cached_here=0), "recompute", None)
    assert failed.received_by_rank == []


@pytest.mark.parametrize("part", [{"rank": 0, "blocks": 5, "bytes": -1}, {"rank": 0, "blocks": 5},
                                  {"rank": "0", "blocks": 5, "bytes": 1}, {"rank": 0, "blocks": 5, "bytes": 1, "x": 1}])
def test_a_malformed_rank_part_is_refused(part):
    said = {"local_tokens": 0, "tokens": 4, "blocks": 1, "bytes": 1, "by_rank": [part]}
    assert received_of({wire.RECEIVED_KEY: said}) is None  # unknown, never guessed
    report = msgspec.json.decode(wire.encode_json(path_report(job(), "d", DecodeSaw(), "recompute", None)))
    with pytest.raises(msgspec.ValidationError):
        wire.decode_json(msgspec.json.encode(report | {"received_by_rank": [part]}), wire.PathReport)


def test_a_path_report_from_a_decode_that_predates_rank_parts_reads_as_none_said():
    report = msgspec.json.decode(wire.encode_json(path_report(job(), "d", DecodeSaw(), "recompute", None)))
    del report["received_by_rank"]
    assert wire.decode_json(msgspec.json.encode(report), wire.PathReport).received_by_rank == []


def test_prefill_computed_is_unknown_when_its_report_never_came():
    report = path_report(job(), "d", DecodeSaw(received=wire.ReceivedKv(local_tokens=0, tokens=100, blocks=7,
                                                                         bytes=7)), "recompute", None)
    assert report.prefill_computed_tokens is None


def test_a_failed_transfer_recomputed_on_decode_counts_its_tokens_as_recomputed():
    failure = load_failure_of({wire.LOAD_FAILURE_KEY: {"code": "checksum_mismatch", "reason": "it differed"}})
    saw = DecodeSaw(computed_here=True, cached_here=48, kv_failure=failure)
    report = path_report(job("pull"), "d", saw, "recompute", wire.PromptReport(cached_tokens=0))
    assert (report.received_tokens, report.received_blocks, report.received_bytes, report.kv_checksum) == (
        0, 0, 0, None)
    assert (report.decode_cached_tokens, report.decode_computed_tokens, report.recomputed_tokens,
            report.kv_failure, report.kv_failure_reason) == (48, 52, 52, "checksum_mismatch", "it differed")
    assert report.prefill_computed_tokens == 100  # prefill did compute it; its KV was what failed
    # A connector that did not say why: still a failure, with a code that says as much.
    unsaid = path_report(job("pull"), "d", DecodeSaw(computed_here=True, cached_here=0), "recompute", None)
    assert (unsaid.kv_failure, unsaid.recomputed_tokens) == ("kv_load_failed", 100)


def test_a_local_request_computes_its_prompt_on_decode_and_recomputes_nothing():
    saw = DecodeSaw(computed_here=True, cached_here=16)
    report = path_report(job("local", wire.RouteReport(chosen_by="request", reason="the request asked for it")),
                         "d", saw, "recompute", None)
    assert (report.prefill_worker, report.prefill_computed_tokens, report.received_tokens,
            report.decode_cached_tokens, report.decode_computed_tokens, report.recomputed_tokens,
            report.kv_failure) == ("", 0, 0, 16, 84, 0, "")


def test_a_connector_that_says_nothing_leaves_the_counts_unknown():
    report = path_report(job(), "d", DecodeSaw(received=received_of(None)), "recompute", None)
    assert (report.received_tokens, report.received_blocks, report.received_bytes,
            report.decode_cached_tokens) == (None, None, None, None)
    assert received_of({wire.RECEIVED_KEY: {"tokens": "many"}}) is None  # malformed: unknown, never guessed


def test_the_scheduler_puts_the_attempt_its_moves_and_takeovers_in_the_job():
    request = ValidRequest("r", PROMPT, SAMPLING, None)
    flight = Flight(request, "_INBOX.c.x", 0.0, 100.0, kv_policy="fail", takeovers=1)
    placement = place(len(PROMPT), None, PlacementSettings(policy="push"), ("push", "pull"), None, None)
    flight.place(placement.mode, placement.chosen_by, placement.reason)
    flight.new_attempt("t1")
    flight.new_attempt("t2")  # a retry
    flight.move_declined()  # asked, not moved: not a move
    flight.moved("decode-1", "inc", "key")
    decode = dispatch.decode_job(flight, None)
    assert decode.kv_policy == "fail"
    assert decode.route == wire.RouteReport(chosen_by="scheduler", reason="the scheduler runs push", attempt=2,
                                            moves=1, takeovers=1)


@pytest.mark.parametrize("requested,policy,chosen_by", [
    ("pull", "push", "request"), (None, "pull", "scheduler"), ("auto", "push", "auto"), (None, "auto", "auto")])
def test_placement_says_who_chose_the_mode(requested, policy, chosen_by):
    placement = place(2000, requested, PlacementSettings(policy=policy), ("push", "pull"), None, None)
    assert placement.chosen_by == chosen_by


def test_the_gateway_shows_the_report_in_the_body_and_a_header():
    report = path_report(job(), "decode-0", DecodeSaw(received=wire.ReceivedKv(local_tokens=0, tokens=100, blocks=7,
                                                                                 bytes=700)), "fail", None)
    final = wire.FinalReply(request_id="r", finish_reason="length", usage=wire.Usage(100, 4),
                            timings=wire.Timings(1.0, 1.0, 1.0), path=report)
    request = requests.parse("completion", {"prompt": "x", "max_tokens": 4, "kv_policy": "fail"}, "m")
    assert request.generate["kv_policy"] == "fail"
    body = responses.response(request, "r", [responses.Answer("abcd", [1, 2, 3, 4], None)], final)
    assert body["kvpush"]["mode"] == "push" and body["kvpush"]["received_blocks"] == 7
    assert body["kvpush"]["prefill_computed_tokens"] is None
    (header,) = responses.path_header(final).values()
    fields = responses.parse_path_header(header)
    assert fields["mode"] == "push" and fields["received_bytes"] == "700" and fields["kv_policy"] == "fail"
    assert "prefill_computed_tokens" not in fields  # unknown: left out
    header.encode("latin-1")  # a header value
    with pytest.raises(Exception, match="kv_policy"):
        requests.parse("completion", {"prompt": "x", "kv_policy": "retry"}, "m")


def test_a_path_report_becomes_span_attributes_opentelemetry_takes_each_rank_a_list_entry():
    """OpenTelemetry takes scalars and lists of scalars; a RankKv in a list it dropped with a
    warning (seen in the demo's log once ranks reported)."""
    path = wire.PathReport(mode="push", chosen_by="auto", reason="asked", prefill_worker="prefill-0",
                           decode_worker="decode-0", attempt=1, moves=0, takeovers=0, kv_policy="recompute",
                           prompt_tokens=100, prefill_computed_tokens=100, received_tokens=100, received_blocks=7,
                           received_bytes=300, decode_cached_tokens=0, decode_computed_tokens=0, recomputed_tokens=0,
                           resumed_after=[4],
                           received_by_rank=[wire.RankKv(rank=0, blocks=7, bytes=100),
                                             wire.RankKv(rank=1, blocks=7, bytes=200)])
    attributes = path_attributes(path)
    scalar = (bool, str, int, float)
    for name, value in attributes.items():
        assert isinstance(value, scalar) or (isinstance(value, list) and all(isinstance(v, scalar) for v in value)), \
            (name, value)
    assert attributes["kvpush.path.received_by_rank.rank"] == [0, 1]
    assert attributes["kvpush.path.received_by_rank.bytes"] == [100, 200]
    assert attributes["kvpush.path.mode"] == "push" and attributes["kvpush.path.resumed_after"] == [4]
