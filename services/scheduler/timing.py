"""How long the scheduler waits for what, and since when it has listened.

Pure: no NATS. Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.shared import settings

DISPATCH_TIMEOUT_S = 5.0
MOVE_TIMEOUT_S = 2.0  # for prefill's answer to a MoveTransfer
WATCH_INTERVAL_S = 0.25  # how often deadlines and worker liveness are checked
UNKNOWN_CLAIM_RETRY_S = 1.0  # an end whose claim JetStream could not settle is tried again this often...
UNKNOWN_CLAIM_GRACE_S = 60.0  # ...until this long past the request's deadline
HEARD_A_ROUND_S = 1.5 * settings.HEARTBEAT_INTERVAL_S  # up this long, a scheduler has heard every live worker
INTAKE_GRACE_S = 2 * settings.HEARTBEAT_INTERVAL_S  # a copy unsettled this long goes to whoever is designated now


@dataclass
class Uptime:
    """Since when this scheduler listens (monotonic): set again once its subscriptions are up."""

    started_at: float

    def heard_a_round(self, now: float) -> bool:
        """Up long enough to have heard every live worker's and scheduler's heartbeat."""
        return now - self.started_at > HEARD_A_ROUND_S
