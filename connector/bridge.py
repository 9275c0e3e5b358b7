"""A NATS connection for code that is not async: vLLM's engine-core process.

One daemon thread runs an asyncio loop with one nats-py connection. Other threads
publish without blocking, subscribe with plain callbacks (run on the bridge thread,
so they must be quick), and make requests whose replies come back as callbacks. One bridge per process and
NATS URL (``NatsBridge.shared``), because both connector roles live in the same
engine-core process on a single-rank engine.

``decoded`` is the connector's one decode-or-refuse boundary: a message that does not
decode, or names a sender other than its subject's (``wire.forged_sender``), is logged,
counted and said on ``kvpush.invalid``, and the handler never sees it.
``every`` sends periodic messages (lease renewals) from the bridge's own loop, so their
cadence does not depend on vLLM's steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Iterable

import msgspec
import nats

from kvpush.otel.messaging import TEMPORARY, consumer, producer, template_of
from kvpush.otel.metrics import instruments
from kvpush.shared import errors, wire
from kvpush.shared.chaos import Chaos
from kvpush.shared.nats_security import connect_options, error_logger, server_urls

log = logging.getLogger("kvpush.bridge")
_refusals = logging.getLogger("kvpush.connector")  # a refused message is the connector's to report

Handler = Callable[[bytes, str], bytes | None]  # (data, subject) -> the reply, if any
Messages = Callable[[], Iterable[tuple[str, bytes]]]


class NatsBridge:
    _shared: dict[str, "NatsBridge"] = {}
    _shared_lock = threading.Lock()  # protects _shared

    @classmethod
    def shared(cls, url: str, name: str) -> "NatsBridge":
        """The process's bridge to ``url``; ``name`` (the engine id) names its inbox."""
        with cls._shared_lock:
            bridge = cls._shared.get(url)
            if bridge is None or bridge._closed:
                bridge = cls._shared[url] = cls(url, name)
                bridge.start()
            return bridge

    @property
    def chaos(self) -> Chaos | None:
        """The process's deliberate faults (``KVPUSH_CHAOS``), if any."""
        return self._chaos

    def __init__(self, url: str, name: str):
        self.url = url
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._nc = None
        self._closed = False
        self._chaos = Chaos.from_env()
        self._periodic: list[asyncio.Task] = []  # every()'s tasks, cancelled on close
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
                nats.connect(server_urls(self.url), name=f"{self.name}-connector", max_reconnect_attempts=-1,
                             error_cb=error_logger(f"{self.name}-connector"), **connect_options(service=self.name))
            )
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def publish(self, subject: str, data: bytes, template: str | None = None) -> None:
        """Publish from any thread, in a PRODUCER span under the caller's current context."""
        with producer(subject, template) as headers:
            self._loop.call_soon_threadsafe(self._publish_soon, subject, data, headers)

    def _publish_soon(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        if self._chaos is None:
            self._loop.create_task(self._publish(subject, data, headers))
            return
        for delay in self._chaos.delays(subject):
            self._loop.call_later(delay, lambda: self._loop.create_task(self._publish(subject, data, headers)))

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        try:
            await self._nc.publish(subject, data, headers=headers)
        except Exception as exc:
            log.warning("publish to %s failed: %s", subject, exc)

    def every(self, interval_s: float, messages: Messages) -> None:
        """Every ``interval_s`` until close, publish the (subject, data) pairs ``messages()``
        returns; it runs on the bridge thread, so it must be quick. Periodic messages are
        not traced, and chaos leaves them alone: the next tick repeats each anyway."""

        async def tick() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    batch = list(messages())
                except Exception:
                    log.exception("periodic messages failed")
                    continue
                for subject, data in batch:
                    await self._publish(subject, data, None)

        self._loop.call_soon_threadsafe(lambda: self._periodic.append(self._loop.create_task(tick())))

    def subscribe(self, subject: str, handler: Handler, template: str | None = None) -> None:
        """``handler(data, subject)`` runs on the bridge thread inside a CONSUMER span
        (named by ``template``, by default the subject's own); bytes it returns are the reply."""
        template = template_of(subject, template)

        async def on_message(msg) -> None:
            with consumer(msg.subject, template, msg.headers):
                try:
                    reply = handler(msg.data, msg.subject)
                except Exception:
                    log.exception("handler for %s failed", subject)
                    return
                if reply is not None and msg.reply and wire.is_inbox(msg.reply):
                    with producer(msg.reply, TEMPORARY) as headers:
                        await self._nc.publish(msg.reply, reply, headers=headers)

        async def subscribe() -> None:
            await self._nc.subscribe(subject, cb=on_message)
            await self._nc.flush()

        asyncio.run_coroutine_threadsafe(subscribe(), self._loop).result(timeout=10)

    def subscribe_typed(self, subject: str, kind, handler: Callable[[Any], None], service: str) -> None:
        """``handler(message)`` with each message on ``subject`` that decodes as ``kind``
        (a Struct type or a union); the others are refused (``decoded``)."""

        def on_data(data: bytes, on_subject: str) -> None:
            message = self.decoded(data, kind, on_subject, service)
            if message is not None:
                handler(message)

        self.subscribe(subject, on_data)

    def decoded(self, data: bytes, kind, subject: str, service: str, reply: bool = False):
        """``data`` (received on ``subject``) as ``kind``; None, said on kvpush.invalid as
        refused by ``service``, if it is not one or its sender is forged. A ``reply`` to a
        request on ``subject`` has no sender token to check: the caller checks it."""
        try:
            message = wire.decode(data, kind)
        except msgspec.MsgspecError as exc:
            self.refuse(errors.refusal(service, subject, exc))
            return None
        forged = None if reply else wire.forged_sender(subject, message)
        if forged is not None:
            self.refuse(errors.refusal(service, subject, ValueError(forged), errors.ForgedSender))
            return None
        return message

    def refuse(self, refusal: wire.InvalidMessage) -> None:
        """Log, count and say on kvpush.invalid that a message was refused (any thread)."""
        _refusals.warning("refused a message on %s (%s): %s", refusal.subject, refusal.code, refusal.reason)
        instruments().failures.add(1, {"reason": refusal.code})
        self.publish(wire.INVALID_SUBJECT, wire.encode(refusal))

    def request_async(
        self, subject: str, data: bytes, timeout: float, on_reply: Callable[[bytes | None, str | None], None],
        template: str | None = None,
    ) -> None:
        """Non-blocking request from any thread; ``on_reply(data, error)`` runs on the bridge thread."""

        with producer(subject, template) as headers:
            pass  # the span marks the send; the reply is awaited on the bridge thread

        async def ask() -> None:
            try:
                msg = await self._nc.request(subject, data, timeout=timeout, headers=headers)
            except Exception as exc:
                on_reply(None, f"{type(exc).__name__} on {subject}: {exc}")
                return
            on_reply(msg.data, None)

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(ask()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(lambda: [task.cancel() for task in self._periodic])
        if self._nc is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._nc.drain(), self._loop).result(timeout=5)
            except Exception:
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
