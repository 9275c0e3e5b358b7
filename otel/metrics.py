"""kvpush's OpenTelemetry metrics, each declared once."""

from __future__ import annotations

from functools import cache

from opentelemetry import metrics

_meter = metrics.get_meter("kvpush")


@cache
def instruments():
    return _Instruments()


class _Instruments:
    def __init__(self) -> None:
        m = _meter
        self.requests = m.create_counter("kvpush.requests", description="requests finished, by outcome")
        self.failures = m.create_counter("kvpush.failures", description="failed requests and transfers, by reason")
        self.ttft = m.create_histogram("kvpush.ttft", unit="ms", description="time to first token")
        self.tpot = m.create_histogram("kvpush.tpot", unit="ms", description="time per output token")
        self.e2e = m.create_histogram("kvpush.e2e", unit="ms", description="request received to final reply")
        self.ttft_stage = m.create_histogram(
            "kvpush.ttft.stage", unit="ms",
            description="TTFT split, by stage: queue (scheduler, to decode's job), wait_kv (decode's job to "
                        "scheduled with its KV: prefill compute, coordination, transfer), first_token")
        self.prefill_duration = m.create_histogram(
            "kvpush.prefill.duration", unit="ms", description="prefill compute, job start to handoff")
        self.in_flight = m.create_gauge("kvpush.scheduler.in_flight", description="requests a scheduler holds")
        self.waiting = m.create_gauge("kvpush.worker.waiting", description="requests queued in a worker's engine")
        self.running = m.create_gauge("kvpush.worker.running", description="requests running in a worker's engine")
        self.http_requests = m.create_counter(
            "kvpush.gateway.requests", description="HTTP requests the gateway answered, by endpoint and status")
        self.transfer_bytes = m.create_histogram("kvpush.transfer.bytes", unit="By", description="bytes per KV push")
        self.transfer_duration = m.create_histogram(
            "kvpush.transfer.duration", unit="ms", description="KV push from post to completion")
        self.descriptors = m.create_histogram(
            "kvpush.transfer.descriptors", description="descriptor ranges per KV push, after coalescing")
        self.rendezvous_wait = m.create_histogram(
            "kvpush.rendezvous.wait", unit="ms", description="how long the first half of a rendezvous waited")
        self.paths = m.create_counter(
            "kvpush.path.requests", description="requests answered, by the mode that served them and who chose it "
                                                "(request, scheduler, auto)")
        self.kv_fallbacks = m.create_counter(
            "kvpush.kv.fallbacks", description="requests whose prompt's KV did not arrive intact, by outcome "
                                               "(recomputed on decode, or failed: kv_policy fail); why: "
                                               "kvpush.kv.load_failures")
        self.recomputed_tokens = m.create_counter(
            "kvpush.kv.recomputed_tokens", description="prompt tokens decode computed again because their KV, "
                                                       "computed by prefill, did not arrive intact")
        self.load_failures = m.create_counter(
            "kvpush.kv.load_failures", description="decode: prompts whose KV did not arrive intact, by reason "
                                                   "(checksum_mismatch, kv_wait_expired, lease_expired, ...)")
        self.checksum_mismatches = m.create_counter(
            "kvpush.kv.checksum_mismatches", description="transfers whose KV, as it landed on decode, differed "
                                                         "from prefill's checksum (failed: kv_policy applies)")
        self.migrations = m.create_counter(
            "kvpush.migrations", description="requests whose decode was lost or stalled mid-stream, by why "
                                             "(lost, stalled) and outcome (reprefill, replay: continued on "
                                             "another decode; refused: ended with worker_lost)")
        self.free_kv_blocks = m.create_gauge("kvpush.worker.free_kv_blocks", description="free KV blocks per worker")
        self.stuck_holds = m.create_gauge(
            "kvpush.kv.stuck_holds",
            description="decode transfers whose blocks are held for a write prefill reported stuck (alert when > 0)")
