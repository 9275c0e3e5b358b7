"""The connector's ear for its worker: "a request was just handed to your engine".

vLLM steps an engine whose requests only wait for KV (or whose blocks only wait to be
sent). The connector's ``get_finished`` turns those empty steps into a wait that a transfer
ending cuts short; this wake cuts it short too, when a new request (or an abort) reaches
the engine, which the connector would otherwise see only at the next step. The worker
(``kvpush.services.worker.engine.wake_engine``) sends the wake just before it hands the request to vLLM, so the wake can arrive first: the
wait that follows a wake is kept short for a moment (``WakeClock``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

log = logging.getLogger("kvpush.connector")

# After a wake, waits stay this short for this long: the request it announced is on its way
# into the engine (a few ms through vLLM's input socket) and is scheduled at the next step.
WOKEN_WAIT_S = 0.002
WOKEN_FOR_S = 0.02


class WakeClock:
    """How long an idle step may wait: ``long_s``, or ``WOKEN_WAIT_S`` just after a wake.
    Pure; the clock is passed in."""

    def __init__(self, long_s: float):
        self.long_s = long_s
        self._woken_at = -1e9

    def woken(self, now: float) -> None:
        self._woken_at = now

    def wait_s(self, now: float) -> float:
        return WOKEN_WAIT_S if now - self._woken_at < WOKEN_FOR_S else self.long_s


class WakeListener:
    """A thread receiving wakes on ``address`` (see ``kvpush.shared.wire.engine_wake_address``)."""

    def __init__(self, address: bytes, on_wake: Callable[[], None]):
        self.address = address
        self._on_wake = on_wake
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(address)  # raises OSError if the address is taken
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvpush-engine-wake", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                self._socket.recv(64)
            except OSError:
                return
            if not self._closed:
                self._on_wake()

    def close(self) -> None:
        self._closed = True
        _send_wake(self.address)  # unblocks the thread's recv
        self._thread.join(timeout=1)
        self._socket.close()


def _send_wake(address: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        try:
            sender.sendto(b"\0", address)
        except OSError:
            pass
