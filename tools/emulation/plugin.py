"""vLLM's ``vllm.general_plugins`` entry point: every vLLM process (kvpush's engines and
``vllm serve`` alike) calls :func:`register` at start.

It registers the timed model's architecture by name (nothing heavy is imported until a folder
names it), and, when ``KVPUSH_NIXL_PROGRESS_THREAD=paced``, paces the progress thread of every
NIXL agent made in the process (vLLM's NixlConnector's included). NIXL's Python wrapper starts
that thread with no delay between its rounds (``pthrDelay = 0``): it spins a core at rest
(1.0 CPU-s/s per agent, measured). A GPU server has spare cores for it; a two-core machine has
none. Paced, the thread waits ``KVPUSH_NIXL_PROGRESS_DELAY_US`` (default 1000) between rounds:
0.03 CPU-s/s at rest, measured. Turning the thread off instead (``enable_prog_thread=False``)
stalled vLLM's pull: a prefill with nothing to compute never stepped, so nothing served
decode's READ. kvpush's connector never starts the thread: its transfer thread polls.

In an emulated engine (``KVPUSH_EMULATION_TARGET`` set) it also keeps the forward thread on
the cores the binding gave it. On CPUs, vLLM's NIXL worker (``NixlBaseConnectorWorker``, under
both NixlConnector and NixlPushConnector) pins the thread that builds it, which is the thread
that runs every forward, to the last core of each NUMA node "for kv transfer": on a two-core
machine, core 1 for the prefill and the decode alike, whatever the binding. The decode's
worker then spins beside the prefill's forward (measured: an 8k prefill's first step did not
end in vLLM's 300 s and the engine died). A GPU server has no such pin (it is CPU-only), so
the emulation undoes it: the thread's cores before the worker was built are set back after.

At tensor parallelism above 1, vLLM's multiprocess executor passes every step through
shared-memory queues whose readers busy-poll for a second after each read
(``shm_broadcast.SpinCondition``), yielding the core between polls (``sched_yield``). While a
step waits in a worker (kvpush's connector waiting for KV), the engine core's reader spins a
whole core: ~1.0 CPU-s/s, measured. ``KVPUSH_SHM_SPIN`` chooses what a reader does between polls:

- ``backoff`` (the default): ``sched_yield`` for the first ``KVPUSH_SHM_SPIN_YIELD_US`` (1000)
  of a wait, then sleeps doubling from 50 µs to ``KVPUSH_SHM_SPIN_SLEEP_US`` (1000);
- ``paced``: a sleep of ``KVPUSH_SHM_SPIN_SLEEP_US`` (100) every time;
- ``on``: vLLM's own ``sched_yield``.

At TP 2 on both sides, kv-heavy 1k prompts at 0.5 req/s, 16 requests, one run each on the
2-core Xeon (docs/benchmarks.md): TTFT p50 push/pull 467/471 ms backoff, 518/573 paced,
470/436 on; TPOT p50 19/17, 22/23, 14/15 ms; a decode engine waiting for KV 0.10, 0.21 and
1.02 CPU-s/s. A 20 ms yield window was worse on every count (568/545 ms, 22/19 ms, 0.22).
The readers still poll the shared memory in that second: only the pause between polls
changes. ``on`` keeps vLLM's own spin. Setting the queue's ``busy_loop_s`` to 0 instead (every
wait on the notification socket) hung TP-2 engines at their first step, 3 of 3 times: not
done here.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

PROGRESS_THREAD_ENV = "KVPUSH_NIXL_PROGRESS_THREAD"  # "on" (NIXL's own) or "paced"
PROGRESS_DELAY_ENV = "KVPUSH_NIXL_PROGRESS_DELAY_US"
ARCHITECTURE = "KvpushTimedForCausalLM"  # what a timed folder's config.json names
MODULE = "kvpush.tools.emulation.timed_model"
STAND_IN_ARCHITECTURE = "KvpushStandInForCausalLM"  # a stand-in folder's (tools/emulation/stand_in.py)
STAND_IN_MODULE = "kvpush.tools.emulation.stand_in"
TARGET_ENV = "KVPUSH_EMULATION_TARGET"  # the emulated deployment, set in every emulated engine
NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
NIXL_WORKER_CLASS = "NixlBaseConnectorWorker"
SHM_SPIN_ENV = "KVPUSH_SHM_SPIN"  # "backoff" (the default), "paced" or "on" (vLLM's own spin)
SHM_SPIN_SLEEP_ENV = "KVPUSH_SHM_SPIN_SLEEP_US"
SHM_SPIN_YIELD_ENV = "KVPUSH_SHM_SPIN_YIELD_US"  # backoff: how long a wait yields before it sleeps
SHM_BROADCAST_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def register() -> None:
    from vllm import ModelRegistry

    for architecture, module in ((ARCHITECTURE, MODULE), (STAND_IN_ARCHITECTURE, STAND_IN_MODULE)):
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"{module}:{architecture}")
    switch = os.environ.get(PROGRESS_THREAD_ENV, "on")
    if switch == "paced":
        _pace_progress_threads(int(os.environ.get(PROGRESS_DELAY_ENV, "1000")))
    elif switch != "on":
        raise ValueError(f"{PROGRESS_THREAD_ENV}={switch!r}: use 'on' or 'paced'")
    pause = shm_spin_pause(os.environ)
    if pause is not None:
        patch_on_import(SHM_BROADCAST_MODULE, lambda module: _pace_shm_spin(module, pause))
    if os.environ.get(TARGET_ENV):
        patch_on_import(NIXL_WORKER_MODULE, _keep_the_builders_cores)


def keeping_thread_cores(function: Callable) -> Callable:
    """``function`` that leaves the calling thread on the cores it had before the call."""

    @functools.wraps(function)
    def kept(*args, **kwargs):
        cores = os.sched_getaffinity(0)
        try:
            return function(*args, **kwargs)
        finally:
            os.sched_setaffinity(0, cores)

    kept.kvpush_keeps_cores = True
    return kept


def _keep_the_builders_cores(module) -> None:
    worker = getattr(module, NIXL_WORKER_CLASS)
    if not getattr(worker.__init__, "kvpush_keeps_cores", False):
        worker.__init__ = keeping_thread_cores(worker.__init__)


def shm_spin_pause(environ) -> Callable[[], None] | None:
    """What the shared-memory queue's waiting readers call between polls, as ``environ`` asks
    (``KVPUSH_SHM_SPIN``: ``paced``, ``backoff`` or ``on``; ``KVPUSH_SHM_SPIN_SLEEP_US``, the
    paced sleep and the backoff's longest; ``KVPUSH_SHM_SPIN_YIELD_US``, how long a backoff
    yields first); None: vLLM's own ``sched_yield``."""
    spin = environ.get(SHM_SPIN_ENV, "backoff")
    if spin == "on":
        return None
    if spin == "paced":
        return paced_yield(int(environ.get(SHM_SPIN_SLEEP_ENV, "100")) / 1e6)
    if spin == "backoff":
        return backoff_yield(Backoff(spin_s=int(environ.get(SHM_SPIN_YIELD_ENV, "1000")) / 1e6,
                                     longest_sleep_s=int(environ.get(SHM_SPIN_SLEEP_ENV, "1000")) / 1e6))
    raise ValueError(f"{SHM_SPIN_ENV}={spin!r}: use 'paced', 'backoff' or 'on'")


def paced_yield(sleep_s: float) -> Callable[[], None]:
    """A stand-in for ``sched_yield`` that gives the core up for ``sleep_s``."""

    def pause() -> None:
        time.sleep(sleep_s)

    pause.kvpush_paced, pause.sleep_s = True, sleep_s
    return pause


@dataclass
class Backoff:
    """How one thread waits between polls: vLLM's ``sched_yield`` for the first ``spin_s``
    of a wait (a step's answer usually comes by then, and the core is handed over, not
    taken), then sleeps that double from ``first_sleep_s`` up to ``longest_sleep_s``, so a
    long wait (a decode waiting for KV) wakes ~1/``longest_sleep_s`` times a second instead
    of 10,000. A call more than ``new_wait_after_s`` after the previous one ended begins a
    new wait (between two polls of one wait the thread does microseconds of work)."""

    spin_s: float = 1e-3
    first_sleep_s: float = 50e-6
    longest_sleep_s: float = 1e-3
    new_wait_after_s: float = 1e-3

    def next_pause(self, now: float, state: dict) -> float:
        """Seconds to sleep now (0: yield instead), for a thread whose ``state`` this keeps."""
        if now - state.get("ended", float("-inf")) > self.new_wait_after_s:
            state["began"], state["sleep"] = now, self.first_sleep_s
        if now - state["began"] < self.spin_s:
            return 0.0
        pause, state["sleep"] = state["sleep"], min(state["sleep"] * 2, self.longest_sleep_s)
        return pause


def backoff_yield(backoff: Backoff) -> Callable[[], None]:
    """A stand-in for ``sched_yield`` that waits as ``backoff`` says, each thread on its own."""
    local = threading.local()

    def pause() -> None:
        state = local.__dict__
        seconds = backoff.next_pause(time.monotonic(), state)
        if seconds:
            time.sleep(seconds)
        else:
            os.sched_yield()
        state["ended"] = time.monotonic()

    pause.kvpush_paced, pause.backoff = True, backoff
    return pause


def _pace_shm_spin(module, pause: Callable[[], None]) -> None:
    """Make the shared-memory queue's spins (readers waiting for a step's input or output,
    writers for a free slot) call ``pause`` between polls. The module imported
    ``sched_yield`` by name, so its own global is the one replaced; queues that already
    exist read it at each call."""
    if not getattr(module.sched_yield, "kvpush_paced", False):
        module.sched_yield = pause


def patch_on_import(name: str, patch: Callable) -> None:
    """Call ``patch(module)`` once module ``name`` is imported in this process (at once if it
    already is), without importing it here: the plugin loads in every vLLM process, most of
    which never use NIXL."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    sys.meta_path.insert(0, _PatchOnImport(name, patch))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable):
        self.name = name
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _pace_progress_threads(delay_us: int) -> None:
    """Make every NIXL agent config made from now on keep at least ``delay_us`` between its
    progress thread's rounds (the wrapper sets 0 after building the config)."""
    try:
        from nixl import _api
    except ImportError:  # no NIXL here: nothing to pace
        return
    base = _api.nixlBind.nixlAgentConfig
    if getattr(base, "kvpush_paced", False):
        return

    class PacedAgentConfig(base):
        kvpush_paced = True

        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    _api.nixlBind.nixlAgentConfig = PacedAgentConfig
