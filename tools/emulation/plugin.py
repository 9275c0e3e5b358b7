"""vLLM's ``vllm.general_plugins`` entry point: every vLLM process (kvpush's engines and
``vllm serve`` alike) calls :func:`register` at start.

It registers the timed model's architecture by name (nothing heavy is imported until a folder
names it), and, when ``KVPUSH_NIXL_PROGRESS_THREAD=off``, turns off the progress thread of
the NIXL agents vLLM's own NixlConnector makes. That thread spins a core at rest; a GPU server
has spare cores for it, a two-core machine has none. vLLM's worker still makes progress: it
polls its transfers' state and notifications every step. kvpush's connector never starts one.
"""

from __future__ import annotations

import os

PROGRESS_THREAD_ENV = "KVPUSH_NIXL_PROGRESS_THREAD"
ARCHITECTURE = "KvpushTimedForCausalLM"  # what a timed folder's config.json names
MODULE = "kvpush.tools.emulation.timed_model"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{MODULE}:{ARCHITECTURE}")
    if os.environ.get(PROGRESS_THREAD_ENV, "on").lower() in ("off", "0", "no", "false"):
        _progress_thread_off()


def _progress_thread_off() -> None:
    from vllm.distributed import nixl_utils

    made = nixl_utils.nixl_agent_config  # resolved through the module's own loader
    if made is None or getattr(made, "_kvpush_no_progress_thread", False):
        return

    def without_progress_thread(*args, **kwargs):
        kwargs["enable_prog_thread"] = False
        return made(*args, **kwargs)

    without_progress_thread._kvpush_no_progress_thread = True
    nixl_utils.nixl_agent_config = without_progress_thread
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    except ImportError:
        return
    base_worker.nixl_agent_config = without_progress_thread
