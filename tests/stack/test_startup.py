"""A service whose start fails part-way closes what it had opened."""

from __future__ import annotations

import pytest

from kvpush.services.worker.service import Worker

pytestmark = pytest.mark.timeout(300)


async def test_a_worker_whose_engine_cannot_start_closes_its_nats_connection(nats_server, tmp_path):
    worker = Worker("prefill", nats_server.url, str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError) as raised:  # huggingface_hub's: not a folder, and not a hub id either
        await worker.__aenter__()
    assert "no-such-model" in str(raised.value)
    assert worker.bus is not None, "the connection was opened before the engine"
    assert worker.bus.nc.is_closed
    assert worker.engine is None
