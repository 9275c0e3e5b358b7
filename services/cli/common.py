"""What every kvpush command shares: messages to the user, the model folder, signals."""

from __future__ import annotations

import asyncio
import signal
import sys

from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.shared.nats_security import connect_options, error_logger, server_urls


def say(message: str) -> None:
    print(f"[kvpush] {message}", file=sys.stderr, flush=True)


def model_path(args) -> str:
    """``--model``, or the built-in small model (built on first use)."""
    if args.model:
        return args.model
    folder = default_model_dir("small")
    say(f"using the built-in small model in {folder} (building it if needed)")
    return str(build_model(folder))


async def until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def until_signalled_or_failed(service) -> str | None:
    """Until SIGINT/SIGTERM (None) or the service can serve no more (why: ``Service.until_failed``)."""
    signalled = asyncio.ensure_future(until_signalled())
    failed = asyncio.ensure_future(service.until_failed())
    await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
    for task in (signalled, failed):
        task.cancel()
    await asyncio.gather(signalled, failed, return_exceptions=True)
    return failed.result() if failed.done() and not failed.cancelled() else None


async def connect(nats_url: str, **kwargs):
    import nats

    kwargs.setdefault("error_cb", error_logger("kvpush"))
    return await nats.connect(server_urls(nats_url), **kwargs, **connect_options())
