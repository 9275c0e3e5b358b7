"""Every default a kvpush process reads, written once.

The CLI's flags (``services.cli.settings``), the engine settings, the connector and the
pure cores take their defaults from here; compose and the docs name the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NATS_PORT = 4222
DEFAULT_NATS_URL = f"nats://127.0.0.1:{DEFAULT_NATS_PORT}"
MAX_MODEL_LEN = 2048  # context the engines serve
TRANSFER_MODE = "push"  # how KV moves unless a request says: push or pull
CONNECTOR = "kvpush"  # the workers' KV connector: kvpush, vllm-nixl or vllm-nixl-push

# The scheduler
DEADLINE_S = 300.0  # every accepted request gets its final message within this
WORKER_TIMEOUT_S = 3.0  # a worker without a heartbeat this long is lost; its requests are retried
MAX_ATTEMPTS = 3  # tries at a request whose workers were lost before it streamed
MAX_IN_FLIGHT = 512  # requests one scheduler holds at once; past it new ones get `overloaded`
SCHEDULER_TIMEOUT_S = 3.0  # a scheduler without a heartbeat this long is lost; others take its flights over

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
