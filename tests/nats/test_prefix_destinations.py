"""With prefix caching on, a decode asks a prefill only for the blocks its own cache lacks,
and a block that holds cached KV (shared with other requests) is never a destination of a
push or of a pull READ: that is how vLLM's push connector corrupted shared prefixes.

vLLM's own scheduler and KV cache manager (prefix caching on, as vLLM defaults) drive our
connector's scheduler side, loaded the way an engine loads it; the connector publishes its
registrations on a real NATS server."""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from kvpush.shared import wire

BLOCK = 16


@pytest.fixture
def decode_scheduler(model_dir, nats_server, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvpush.services.worker.engine import engine_kwargs
    from kvpush.services.worker.engine_settings import EngineSettings

    engine = EngineSettings(model=model_dir, role="decode", engine_id=f"decode-{uuid.uuid4().hex[:8]}",
                            nats_url=nats_server.url, max_model_len=1024, block_size=BLOCK)
    kwargs = engine_kwargs(engine)
    assert kwargs["enable_prefix_caching"] is True  # kvpush's workers run vLLM's default
    config = EngineArgs(**kwargs).create_engine_config()
    num_blocks = 96  # few enough that cached blocks get evicted and their memory reused
    config.cache_config.num_gpu_blocks = num_blocks
    # The connector sets up OpenTelemetry for the process it is loaded in, once, as for an
    # engine core. Here that is the test process: every later test's spans would then be
    # written to a file one by one on the event loop, which starved the scheduler of the
    # flood test (tests/nats/test_scheduler_bounds.py) until its JetStream acks timed out.
    # OTel's own switch keeps this process's tracing as it was: off.
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    scheduler.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
    yield scheduler
    scheduler.shutdown()


def _request(scheduler, prompt: list[int], mode: str | None, remote_blocks: int = 0):
    """A request as the decode worker hands it to the engine: its KV from a prefill engine
    (push, or pull from ``remote_blocks`` blocks there), or computed here (mode None)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request_id = uuid.uuid4().hex[:12]
    params = None
    if mode is not None:
        params = wire.DecodeKvParams(transfer_id=f"t-{request_id}", request_id=request_id,
                                     prefill_engine_id="prefill-0", mode=mode, transfer_key="k" * 32,
                                     remote_block_ids=list(range(100, 100 + remote_blocks))).as_params()
    sampling = SamplingParams(max_tokens=8, temperature=0.0)
    sampling.update_from_generation_config({}, None)
    request = Request(request_id, list(prompt), sampling, None, block_hasher=scheduler.block_hasher)
    request.kv_transfer_params = params
    return request


def _schedule(scheduler, requests):
    """One engine step over these new requests: what its connector asked of prefill."""
    for request in requests:
        scheduler.add_request(request)
    meta = scheduler.schedule().kv_connector_metadata
    registrations = [wire.decode(expected.registration, wire.Registration) for expected in meta.expected]
    return registrations, meta.reads


def _check_destinations(scheduler, request, first_block: int, block_ids: list[int]) -> None:
    """The prompt's first ``first_block`` blocks are the decode's own cache hit, the rest
    are fresh blocks of this request alone: no cached KV, no other owner."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool.blocks
    (owned,) = manager.get_block_ids(request.request_id)
    needed = -(-len(request.prompt_token_ids) // BLOCK)
    assert owned[first_block:needed] == block_ids
    assert all(pool[b].block_hash is not None for b in owned[:first_block]), "the skipped blocks are a cache hit"
    for block_id in block_ids:
        block = pool[block_id]
        assert block.block_hash is None, f"block {block_id} holds cached KV and was made a destination"
        assert block.ref_cnt == 1, f"block {block_id} is shared and was made a destination"
    others = {b for r in scheduler.requests.values() if r.request_id != request.request_id
              for b in manager.get_block_ids(r.request_id)[0]}
    assert not others & set(block_ids), "a destination is another request's block"


def test_a_decode_registers_only_the_blocks_its_cache_lacks(decode_scheduler):
    prefix = list(range(1, 41))  # 2.5 blocks: its third block is never cached whole
    running = _request(decode_scheduler, prefix + [7] * 24, mode=None)  # computed here: 4 blocks cached
    pushed = _request(decode_scheduler, prefix + [9] * 30, mode="push")  # shares 2 blocks with it
    pulled = _request(decode_scheduler, prefix + [9] * 30, mode="pull", remote_blocks=5)
    whole = _request(decode_scheduler, prefix + [7] * 24, mode="push")  # all 4 blocks cached
    registrations, reads = _schedule(decode_scheduler, [running, pushed, pulled, whole])

    by_request = {r.decode_request_id: r for r in registrations}
    assert by_request[pushed.request_id].first_block == 2
    assert len(by_request[pushed.request_id].block_ids) == 3  # blocks 2, 3, 4 of 70 tokens
    assert by_request[pushed.request_id].num_tokens == 70
    _check_destinations(decode_scheduler, pushed, 2, by_request[pushed.request_id].block_ids)
    # A whole cached prompt: vLLM computes its last token again, so the last block comes anew.
    assert by_request[whole.request_id].first_block == 3
    _check_destinations(decode_scheduler, whole, 3, by_request[whole.request_id].block_ids)
    (read,) = reads
    assert read.first_block == 2 and read.sources == [102, 103, 104]  # prefill's blocks it lacks
    _check_destinations(decode_scheduler, pulled, 2, read.local_block_ids)


def test_no_cached_block_is_ever_a_destination(decode_scheduler):
    """Random traffic over a few shared prefixes (some ending mid-block), computed here,
    pushed and pulled, with requests aborted and cached blocks evicted for reuse: every
    block a registration or a READ names is fresh and this request's alone."""
    from vllm.v1.request import RequestStatus

    rng = random.Random(7)
    bases = [[rng.randrange(1, 4000) for _ in range(n)] for n in (20, 48, 75, 130)]
    live, requests = [], {}
    checked = partial = 0
    for _ in range(40):
        batch = []
        for _ in range(rng.randrange(1, 4)):
            base = rng.choice(bases)
            prompt = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(1, 4000)
                                                                for _ in range(rng.randrange(0, 40))]
            mode = rng.choice([None, "push", "pull"])
            batch.append(_request(decode_scheduler, prompt, mode, remote_blocks=-(-len(prompt) // BLOCK)))
        requests.update((r.request_id, r) for r in batch)
        registrations, reads = _schedule(decode_scheduler, batch)  # an earlier request may get its blocks now
        for registration in registrations:
            request = requests[registration.decode_request_id]
            _check_destinations(decode_scheduler, request, registration.first_block, registration.block_ids)
            checked += 1
            partial += registration.first_block > 0
        for read in reads:
            _check_destinations(decode_scheduler, requests[read.request_id], read.first_block, read.local_block_ids)
            assert len(read.sources) == len(read.local_block_ids)
            checked += 1
            partial += read.first_block > 0
        live += batch
        while len(live) > 6:  # free some: their full blocks stay cached until evicted
            gone = live.pop(rng.randrange(len(live)))
            decode_scheduler.finish_requests([gone.request_id], RequestStatus.FINISHED_ABORTED)
    assert checked >= 30 and partial >= 10, (checked, partial)  # the traffic did hit the cache


def test_loading_the_connector_here_leaves_this_processs_tracing_off(decode_scheduler):
    """The connector sets up OpenTelemetry for the process it is loaded in; in this test
    process that would make every later test's spans real, and written one by one to a
    file. With the fixture's OTEL_SDK_DISABLED they stay what they were: not recorded."""
    from opentelemetry import trace

    assert decode_scheduler.connector is not None  # ours, loaded here
    span = trace.get_tracer("kvpush.tests").start_span("after the connector")
    assert not span.is_recording()
    span.end()
