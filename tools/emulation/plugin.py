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
"""

from __future__ import annotations

import os

PROGRESS_THREAD_ENV = "KVPUSH_NIXL_PROGRESS_THREAD"  # "on" (NIXL's own) or "paced"
PROGRESS_DELAY_ENV = "KVPUSH_NIXL_PROGRESS_DELAY_US"
ARCHITECTURE = "KvpushTimedForCausalLM"  # what a timed folder's config.json names
MODULE = "kvpush.tools.emulation.timed_model"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{MODULE}:{ARCHITECTURE}")
    switch = os.environ.get(PROGRESS_THREAD_ENV, "on")
    if switch == "paced":
        _pace_progress_threads(int(os.environ.get(PROGRESS_DELAY_ENV, "1000")))
    elif switch != "on":
        raise ValueError(f"{PROGRESS_THREAD_ENV}={switch!r}: use 'on' or 'paced'")


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
