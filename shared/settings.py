"""Every default a kvpush process reads, written once.

The CLI's flags (``kvpush.services.cli.settings``), the engine settings, the connector and the
pure cores take their defaults from here; compose and the docs name the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NATS_PORT = 4222
DEFAULT_NATS_URL = f"nats://127.0.0.1:{DEFAULT_NATS_PORT}"
MAX_MODEL_LEN = 2048  # context the engines serve
TRANSFER_MODE = "push"  # how a request is served unless it says: push, pull, or auto (decided per request)
CONNECTOR = "kvpush"  # the workers' KV connector: kvpush, vllm-nixl or vllm-nixl-push
PREFIX_CACHING = "on"  # the engines' prefix caching (vLLM's default): on or off
# structured JSON output: whitespace the grammar allows between tokens, "any" (vLLM's default)
# or "none" (vLLM's disable_any_whitespace, which this vLLM reads per engine, not per request)
JSON_WHITESPACE = "any"
# prefill: write each layer's KV as the forward finishes it. "auto": on for engines on GPUs,
# where it measured better (emulated 8k and 16k: no transfer left after the prompt); off on
# CPUs until the fault suites have run with it there, though it measured better there too
# (docs/benchmarks.md, issue 27).
PUSH_BY_LAYER = "auto"

# The scheduler
DEADLINE_S = 300.0  # every accepted request gets its final message within this
WORKER_TIMEOUT_S = 3.0  # a worker without a heartbeat this long is lost; its requests are retried
MAX_ATTEMPTS = 3  # tries at a request whose workers were lost before it streamed
MAX_MIGRATIONS = 2  # times a request whose decode was lost mid-stream continues on another
STALL_S = 30.0  # a decode streaming a request (its worker heartbeating) without a token this long has stalled
MAX_IN_FLIGHT = 512  # requests one scheduler holds at once; past it new ones get `overloaded`
# End-to-end KV checksums (connector/checksums.py): which transfers get one, off, sampled
# (KV_CHECKSUM_FRACTION of them) or full. Full: its cost measured on CPUs is 0.1-8 ms a side
# at 1k-4k tokens, within the TTFT's noise (docs/benchmarks.md), and sampling would miss
# 7 in 8 corruptions.
KV_CHECKSUMS = "full"
KV_CHECKSUM_FRACTION = 0.125
KV_POLICY = "recompute"  # a request whose KV did not arrive intact: decode computes its prompt, or it fails
SCHEDULER_TIMEOUT_S = 3.0  # a scheduler without a heartbeat this long is lost; others take its flights over

# Placement (--mode auto): services/scheduler/placement.py
# Measured (docs/benchmarks.md, mixed lengths, 1P1D, 0.5 req/s): below ~1000 tokens the decode
# computing the prompt itself beat push and pull; 1000-1500 even; above, pull was faster.
LOCAL_PREFILL_TOKENS = 1024  # prompts shorter than this are computed by their decode
PUSH_WITHIN_S = 1.0  # push when prefill should end within this; later, pull (decode chosen when it ends)
OVERLOADED_WAITING = 4  # a decode with this many requests queued in its engine, while another has none, is
# overloaded: a push transfer bound to it and not yet written moves to the other
HANDOFF_S = 0.03  # what disaggregating adds to a prompt's prefill: dispatch, transfer, noticing it (p50 measured)
DECODE_ROOM = 4  # a decode running fewer requests than this has room to compute a prompt
PREFIX_WEIGHT = 1.0  # routing: a decode holding a whole prompt cached counts one request less busy

# Prefixes fetched from the engine holding them: services/scheduler/prefix_sources.py
PREFIX_FETCH = "on"  # a prompt's longest cached prefix, held elsewhere, may be READ from its holder
FETCH_MIN_TOKENS = 64  # a smaller difference is computed again
# NIXL over UCX between two engines on one host here: 2.2-5.7 GiB/s for large transfers
# (docs/benchmarks.md), far less for a few hundred KiB; the low end, to stay honest.
FETCH_LINK_BYTES_PER_S = 2.0e9
FETCH_FIXED_S = 0.02  # a lend: NATS round trip, a step of the holder's engine, the READ's setup (p50 measured)
FETCH_STEP_TOKENS = 2048  # a holder's step computes at most this much of its queue before the lend's
FETCH_CREDIT = 0.8  # routing: a prefix an engine could fetch counts this much of one it holds

# The workers
HEARTBEAT_INTERVAL_S = 1.0  # also how often decode renews prefill's leases


@dataclass(frozen=True)
class FaultSettings:
    """How long kvpush's connector waits for a peer before giving blocks up, and what
    decode does when pushed KV will not come (vLLM recomputes the prompt, or fails)."""

    lease_s: float = 10.0  # prefill keeps an unclaimed prompt's blocks this long without a renewal
    kv_wait_s: float = 120.0  # decode gives registered blocks up after this long without the KV
    quarantine_s: float = 15.0  # ...and keeps them this long more unless prefill answers the revoke
    on_kv_failure: str = "recompute"  # or "fail"

    def __post_init__(self) -> None:
        # Decode gives blocks up, stops renewing, and revokes (again each second). If every
        # Revoke is lost, prefill drops the registration once its lease runs out: that must
        # happen before decode's quarantine ends and the blocks go back to vLLM. A renewal
        # sent just before the give-up, and one step of the engine, come on top of the lease.
        least = self.lease_s + 2 * HEARTBEAT_INTERVAL_S
        if self.quarantine_s < least:
            raise ValueError(
                f"quarantine_s ({self.quarantine_s:g} s) must be at least lease_s + {2 * HEARTBEAT_INTERVAL_S:g} s "
                f"({least:g} s): otherwise, with its Revoke lost, decode could free blocks that prefill "
                "still holds a registration for and may write into")
        if self.on_kv_failure not in ("recompute", "fail"):
            raise ValueError(f"on_kv_failure must be recompute or fail, not {self.on_kv_failure!r}")


FAULTS = FaultSettings()
