"""What the engine's prefix cache stores and evicts, relayed onto NATS for the schedulers'
routing (``wire.CacheEvents`` on ``kvpush.cache.<worker>``).

vLLM 0.32 publishes its KV cache events only over ZMQ, from the engine-core process
(``--kv-events-config``). The worker has it publish on a local socket of this start's
own (``events_endpoint``), listens there, keys the blocks as schedulers do
(``cache_keys.CacheKeys``) and publishes what changed, at most ``MAX_CACHE_KEYS`` keys
a message. Lost events cost routing quality, never correctness: nothing here is
retried or replayed.
"""

from __future__ import annotations

import asyncio
import hashlib

import structlog

from kvpush.services.worker.cache_keys import CacheChanges, CacheKeys
from kvpush.shared import wire

log = structlog.get_logger("kvpush.worker")


def events_endpoint(engine_id: str, incarnation: str) -> str:
    """Where this start's engine publishes its KV cache events: a socket in Linux's abstract
    namespace (nothing left behind on a crash), unique per engine start."""
    digest = hashlib.sha256(f"{engine_id}\0{incarnation}".encode()).hexdigest()[:32]
    return f"ipc://@kvpush-cache-{digest}"


def kv_events_config(endpoint: str) -> dict:
    """vLLM's ``kv_events_config`` for an engine that publishes to ``endpoint``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kvpush"}


def messages(worker_id: str, incarnation: str, changes: CacheChanges) -> list[wire.CacheEvents]:
    """``changes`` as CacheEvents of at most MAX_CACHE_KEYS keys each, in order: removals
    (after a clear) before the blocks stored since."""
    limit = wire.MAX_CACHE_KEYS
    stored, removed = list(changes.stored), list(changes.removed)
    out = [wire.CacheEvents(worker_id=worker_id, incarnation=incarnation, removed=removed[i:i + limit],
                            cleared=changes.cleared and i == 0)
           for i in range(0, len(removed), limit)]
    if changes.cleared and not out:
        out.append(wire.CacheEvents(worker_id=worker_id, incarnation=incarnation, cleared=True))
    out += [wire.CacheEvents(worker_id=worker_id, incarnation=incarnation, stored=stored[i:i + limit])
            for i in range(0, len(stored), limit)]
    return out


class CacheRelay:
    def __init__(self, bus, worker_id: str, incarnation: str, block_size: int, endpoint: str):
        self.bus = bus
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.endpoint = endpoint
        self.keys = CacheKeys(block_size)
        self._socket = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._relay())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)

    async def _relay(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while True:
            try:
                frames = await self._socket.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the socket is gone: routing goes on without this worker's cache
                log.warning("stopped relaying KV cache events", error=str(exc))
                return
            try:
                batch = decoder.decode(frames[-1])
            except (msgspec.MsgspecError, IndexError) as exc:
                log.warning("unreadable KV cache event", error=str(exc))
                continue
            for message in messages(self.worker_id, self.incarnation, self.keys.apply(batch.events)):
                try:
                    await self.bus.nc.publish(wire.CACHE_EVENTS(sender=self.worker_id), wire.encode(message))
                except Exception as exc:  # NATS down: these changes are lost, the next ones go
                    log.warning("could not relay KV cache events", error=str(exc))
