"""Deliberate message faults, for the fault-injection suite and the soak run.

Off unless ``KVPUSH_CHAOS`` is set. It maps subject prefixes to fault rates::

    KVPUSH_CHAOS='{"kvpush.kv.register.": {"drop": 0.1, "duplicate": 0.1, "delay": 0.2, "max_delay_s": 0.5}}'

Each message published through the connector's NATS bridge on a matching subject is
dropped, sent twice, or held back for a random time (which also reorders it behind
later messages), with those probabilities; periodic ones (``NatsBridge.every``: lease
renewals) are left alone, like the workers' heartbeats. ``KVPUSH_CHAOS_FILE`` names a
file holding the same JSON instead, read again whenever it changes (no file: no
faults), so a test can turn faults on and off in running engines. ``KVPUSH_CHAOS_SEED``
fixes the dice; ``KVPUSH_CHAOS_LOG`` names a file that gets one line per fault,
``<kind> <subject>``, so a run can report what it injected. Under ``kv.flip`` (not a
subject) a ``flip`` rate corrupts one byte of a transfer's blocks on decode once they
landed (``flips``): what end-to-end KV checksums must catch; under ``kv.flip.<rank>``, only in
that decode rank's blocks (one rank's part of the KV corrupted). Under ``kv.write.<rank>``
a ``drop`` rate fails that prefill rank's WRITEs before they are posted (``drops``), as
if NIXL refused them: one rank's part of a transfer lost, the others landing.

No NATS: the bridge asks ``delays(subject)`` and sends accordingly. Standard library
only, and in ``shared`` because both the connector and the scheduler have hold points.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass

RELOAD_EVERY_S = 0.5
# Not a subject: a decode's connector flips one byte in a transfer's blocks after they
# landed and before it checks them ({"kv.flip": {"flip": 1.0}}), to show what checksums catch;
# ``kv.flip.<rank>``: only that decode rank's connector does.
FLIP_POINT = "kv.flip"
# Not a subject either: ``kv.write.<rank>`` {"drop": rate} fails that rank's WRITEs before
# they are posted (the transfer thread asks ``drops``), one rank's part of the KV lost.
WRITE_POINT = "kv.write"


@dataclass(frozen=True)
class Rates:
    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    max_delay_s: float = 0.5
    flip: float = 0.0  # under FLIP_POINT: the fraction of arrived transfers that get one byte flipped


def parse(spec: str) -> dict[str, Rates]:
    return {prefix: Rates(**fields) for prefix, fields in json.loads(spec).items()}


class Chaos:
    def __init__(self, rates: dict[str, Rates] | None = None, seed: int | None = None,
                 log_path: str | None = None, spec_file: str | None = None):
        self.rates = rates or {}
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # protects _random, the rates' reload and the log file
        self._log_path = log_path
        self._spec_file = spec_file
        self._spec_stamp: float | None = None
        self._checked_at = 0.0

    @classmethod
    def from_env(cls, env=os.environ) -> "Chaos | None":
        spec, spec_file = env.get("KVPUSH_CHAOS"), env.get("KVPUSH_CHAOS_FILE")
        if not spec and not spec_file:
            return None
        seed = env.get("KVPUSH_CHAOS_SEED")
        return cls(parse(spec) if spec else None, int(seed) if seed else None, env.get("KVPUSH_CHAOS_LOG"),
                   spec_file)

    def delays(self, subject: str) -> list[float]:
        """How many copies of a message on ``subject`` to send, each after how long:
        [] drops it, [0.0] sends it as is."""
        with self._lock:
            self._reload()
            rates = next((r for prefix, r in self.rates.items() if subject.startswith(prefix)), None)
            if rates is None:
                return [0.0]
            roll = self._random.random()
            if roll < rates.drop:
                kind, copies = "drop", []
            elif roll < rates.drop + rates.duplicate:
                kind, copies = "duplicate", [0.0, self._random.uniform(0.0, rates.max_delay_s)]
            elif roll < rates.drop + rates.duplicate + rates.delay:
                kind, copies = "delay", [self._random.uniform(0.0, rates.max_delay_s)]
            else:
                return [0.0]
            if self._log_path:
                with open(self._log_path, "a") as out:
                    out.write(f"{kind} {subject}\n")
        return copies

    def flips(self, transfer_id: str, rank: int = 0) -> int | None:
        """``FLIP_POINT``'s dice (or ``kv.flip.<rank>``'s) for one transfer that landed in
        ``rank``'s blocks: a seed for where to flip a byte of them, or None to leave them alone."""
        with self._lock:
            line = f"flip {transfer_id}"
            if not (self._rolled(FLIP_POINT, "flip", line) or self._rolled(f"{FLIP_POINT}.{rank}", "flip", line)):
                return None
            return self._random.getrandbits(32)

    def drops(self, point: str) -> bool:
        """The dice of a named point's ``drop`` rate (``WRITE_POINT``'s, say): True to fail it."""
        with self._lock:
            return self._rolled(point, "drop", f"drop {point}")

    def _rolled(self, point: str, rate: str, line: str) -> bool:
        """Under the lock: the dice of ``point``'s ``rate`` came up (logged as ``line``)."""
        self._reload()
        rates = self.rates.get(point)
        if rates is None or self._random.random() >= getattr(rates, rate):
            return False
        if self._log_path:
            with open(self._log_path, "a") as out:
                out.write(line + "\n")
        return True

    def _reload(self) -> None:
        if self._spec_file is None or time.monotonic() - self._checked_at < RELOAD_EVERY_S:
            return
        self._checked_at = time.monotonic()
        try:
            stamp = os.stat(self._spec_file).st_mtime
        except OSError:
            stamp = None
        if stamp == self._spec_stamp:
            return
        self._spec_stamp = stamp
        try:
            self.rates = parse(open(self._spec_file).read()) if stamp is not None else {}
        except (OSError, ValueError, TypeError):
            self.rates = {}  # half-written or bad: no faults until it is readable


# --------------------------------------------------------------------------- hold points
# A race test holds a thread at a named point in the connector or the scheduler, does what
# must happen in between (say, deliver a Revoke), and lets it go: the interleaving is then
# certain, not a matter of sleeps. In-process with ``hold``; across processes (an engine the
# test started), while the file named by KVPUSH_HOLD_FILE lists the point's name. When no
# test holds one, ``point`` is a dict lookup and returns at once.

class Gate:
    def __init__(self) -> None:
        self.reached = threading.Event()  # a thread arrived at the point
        self.opened = threading.Event()  # ...and may go on

    def open(self) -> None:
        self.opened.set()


_gates: dict[str, Gate] = {}
_GATE_TIMEOUT_S = 30.0  # a forgotten gate stalls a thread this long at most
_HOLD_FILE = os.environ.get("KVPUSH_HOLD_FILE")
_HOLD_POLL_S = 0.02


def point(name: str) -> None:
    gate = _gates.get(name)
    if gate is not None:
        gate.reached.set()
        gate.opened.wait(_GATE_TIMEOUT_S)
    if _HOLD_FILE is not None and _held_by_file(name):
        _say_reached(name)
        deadline = time.monotonic() + _GATE_TIMEOUT_S
        while _held_by_file(name) and time.monotonic() < deadline:
            time.sleep(_HOLD_POLL_S)


def reached_file(hold_file: str) -> str:
    """Where a process held by ``hold_file`` writes the name of each point it stopped at
    and its pid (one line each), so the test in another process knows the hold has begun,
    and where."""
    return hold_file + ".reached"


def _say_reached(name: str) -> None:
    try:
        with open(reached_file(_HOLD_FILE), "a") as reached:
            reached.write(f"{name} {os.getpid()}\n")  # which process: a test may kill that one
    except OSError:
        pass


def _held_by_file(name: str) -> bool:
    try:
        with open(_HOLD_FILE) as held:
            return name in held.read().split()
    except OSError:
        return False


class hold:
    """``with hold("producer.matched") as gate:`` threads stop at that point until
    ``gate.open()`` (or the block ends)."""

    def __init__(self, name: str):
        self.name = name
        self.gate = Gate()

    def __enter__(self) -> Gate:
        _gates[self.name] = self.gate
        return self.gate

    def __exit__(self, *exc) -> None:
        _gates.pop(self.name, None)
        self.gate.open()
