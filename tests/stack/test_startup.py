"""A service whose start fails part-way closes what it had opened."""

from __future__ import annotations

import pytest

from services.worker.service import Worker

pytestmark = pytest.mark.timeout(300)


async def test_a_worker_whose_engine_cannot_start_closes_its_nats_connection(nats_server, tmp_path):
    worker = Worker("prefill", nats_server.url, str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError) as raised:  # huggingface_hub's: not a folder, and not a hub id either
        await worker.__aenter__()
    assert "no-such-model" in str(raised.value)
    assert worker.bus is not None, "the connection was opened before the engine"
    assert worker.bus.nc.is_closed
    assert worker.engine is None


def test_a_kvpush_engine_with_prefix_caching_is_refused_at_start_up(model_dir, nats_server):
    """With prefix caching, a prompt's blocks can be shared with other requests: a push into
    them would overwrite KV others read. The connector refuses to start, with the fix."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from connector.kvpush_connector import KvpushConnector
    from services.worker.engine import EngineSettings, engine_kwargs

    kwargs = engine_kwargs(EngineSettings(model=model_dir, role="decode", engine_id="decode-0",
                                          nats_url=nats_server.url, max_model_len=256))
    assert kwargs["enable_prefix_caching"] is False  # what kvpush's own workers run
    config = EngineArgs(**{**kwargs, "enable_prefix_caching": True}).create_engine_config()
    with pytest.raises(ValueError, match="does not support prefix caching yet.*--no-enable-prefix-caching"):
        KvpushConnector(config, KVConnectorRole.SCHEDULER)
