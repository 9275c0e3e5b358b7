# Experiment only (issue 44): cap vLLM's shm_broadcast reader busy-poll in every process
# (spawned workers included), as kvpush's vllm.general_plugins plugin would.
import os
_limit = os.environ.get("EXP_SHM_BUSY_LOOP_S")
if _limit is not None:
    from kvpush.tools.emulation.plugin import patch_on_import

    def _patch(module):
        cls = module.SpinCondition
        orig = cls.wait
        limit = float(_limit)
        def wait(self, timeout_ms=None):
            if self.busy_loop_s > limit:
                self.busy_loop_s = limit
            return orig(self, timeout_ms)
        cls.wait = wait
        if os.environ.get("EXP_VERBOSE"):
            print(f"[sitecustomize pid {os.getpid()}] SpinCondition.wait capped at {limit}s", flush=True)

    patch_on_import("vllm.distributed.device_communicators.shm_broadcast", _patch)

if os.environ.get("EXP_FAULTHANDLER"):
    import faulthandler, signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)

_sleep = os.environ.get("EXP_SHM_YIELD_SLEEP_S")
if _sleep is not None:
    from kvpush.tools.emulation.plugin import patch_on_import
    import time as _time

    def _patch_yield(module):
        s = float(_sleep)
        module.sched_yield = lambda: _time.sleep(s)
        if os.environ.get("EXP_VERBOSE"):
            print(f"[sitecustomize pid {os.getpid()}] shm_broadcast.sched_yield -> sleep({s})", flush=True)

    patch_on_import("vllm.distributed.device_communicators.shm_broadcast", _patch_yield)
