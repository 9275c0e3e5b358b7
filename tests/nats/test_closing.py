"""A service stopping while its NATS server is away stops cleanly: nats-py refuses to drain a
reconnecting connection (a gateway in CI raised ConnectionReconnectingError from close and
exited with a traceback), so it is closed as it is."""

from __future__ import annotations

import asyncio

import nats
import pytest

from kvpush.services.bus import Bus, close_connection
from kvpush.services.launch.natsd import LocalNatsServer

pytestmark = pytest.mark.timeout(60)


async def test_a_connection_whose_server_is_gone_is_closed_not_drained():
    with LocalNatsServer() as server:
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

        async def ignore(msg):
            pass

        await nc.subscribe("kvpush.test", cb=ignore)
        server.stop()
        for _ in range(200):
            if nc.is_reconnecting:
                break
            await asyncio.sleep(0.05)
        assert nc.is_reconnecting
        await Bus(nc, "test").close()  # every service's close
        assert nc.is_closed


async def test_a_connected_connection_is_drained():
    with LocalNatsServer() as server:
        nc = await nats.connect(server.url)
        got = []

        async def slow(msg):
            await asyncio.sleep(0.2)
            got.append(msg.data)

        await nc.subscribe("kvpush.test", cb=slow)
        await nc.publish("kvpush.test", b"x")
        await nc.flush()
        await close_connection(nc)  # drains: the callback under way finishes first
        assert nc.is_closed and got == [b"x"]
