"""A NATS connection for code that is not async: vLLM's engine-core process.

One daemon thread runs an asyncio loop with one nats-py connection. Other threads
publish without blocking, subscribe with plain callbacks (run on the bridge thread,
so they must be quick), and may make blocking requests. One bridge per process and
NATS URL (``NatsBridge.shared``), because both connector roles live in the same
engine-core process on a single-rank engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Callable

import nats

log = logging.getLogger("kvpush.bridge")

Handler = Callable[[bytes], bytes | None]


class NatsBridge:
    _shared: dict[str, "NatsBridge"] = {}
    _shared_lock = threading.Lock()  # protects _shared

    @classmethod
    def shared(cls, url: str, name: str = "kvpush-connector") -> "NatsBridge":
        with cls._shared_lock:
            bridge = cls._shared.get(url)
            if bridge is None or bridge._closed:
                bridge = cls._shared[url] = cls(url, name)
                bridge.start()
            return bridge

    def __init__(self, url: str, name: str):
        self.url = url
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._nc = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvpush-nats-{name}", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"could not connect to NATS at {self.url} within {timeout} s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._nc = self._loop.run_until_complete(
                nats.connect(self.url, name=self.name, max_reconnect_attempts=-1)
            )
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def publish(self, subject: str, data: bytes) -> None:
        self._loop.call_soon_threadsafe(self._publish_soon, subject, data)

    def _publish_soon(self, subject: str, data: bytes) -> None:
        self._loop.create_task(self._publish(subject, data))

    async def _publish(self, subject: str, data: bytes) -> None:
        try:
            await self._nc.publish(subject, data)
        except Exception as exc:
            log.warning("publish to %s failed: %s", subject, exc)

    def subscribe(self, subject: str, handler: Handler) -> None:
        async def on_message(msg) -> None:
            try:
                reply = handler(msg.data)
            except Exception:
                log.exception("handler for %s failed", subject)
                return
            if reply is not None and msg.reply:
                await self._nc.publish(msg.reply, reply)

        async def subscribe() -> None:
            await self._nc.subscribe(subject, cb=on_message)
            await self._nc.flush()

        asyncio.run_coroutine_threadsafe(subscribe(), self._loop).result(timeout=10)

    def request(self, subject: str, data: bytes, timeout: float = 5.0) -> bytes:
        """Blocking request; never call it from the bridge thread itself."""
        future = asyncio.run_coroutine_threadsafe(
            self._nc.request(subject, data, timeout=timeout), self._loop
        )
        try:
            return future.result(timeout + 1).data
        except concurrent.futures.TimeoutError as exc:
            raise TimeoutError(f"no reply on {subject} within {timeout} s") from exc

    def request_async(
        self, subject: str, data: bytes, timeout: float, on_reply: Callable[[bytes | None, str | None], None]
    ) -> None:
        """Non-blocking request from any thread; ``on_reply(data, error)`` runs on the bridge thread."""

        async def ask() -> None:
            try:
                msg = await self._nc.request(subject, data, timeout=timeout)
            except Exception as exc:
                on_reply(None, f"{type(exc).__name__} on {subject}: {exc}")
                return
            on_reply(msg.data, None)

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(ask()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._nc is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._nc.drain(), self._loop).result(timeout=5)
            except Exception:
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
