"""Prefix caching on, on both engines (vLLM's default): decode asks only for the blocks its
cache lacks, prefill computes only what its cache lacks, and the two differ. Every output
equals the single-instance reference (prefix caching on there too), and no block leaks.

One rig (tools/reliability/fault_rig.py), cases in order: what each engine has cached is
set up by the cases before it. A local request (computed by decode alone) warms decode
only; restarting decode leaves a prefix cached on prefill only. Decode runs at TP 2, prefill at TP 1.
"""

from __future__ import annotations

import uuid

import pytest

from kvpush.shared import wire
from kvpush.shared.block_keys import block_keys
from tests import prompts
from kvpush.tools.reliability.fault_rig import running_rig, wait_until

pytestmark = pytest.mark.timeout(900)

CASES = {name: index for index, (name, _) in enumerate(prompts.PREFIX_CASES)}
BLOCK = prompts.BLOCK_SIZE


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    """Decode at TP 2 (issue 44), prefill at TP 1: decode's two ranks each hold half the KV
    heads of every cached block, lend them as two ranks (prefill READs its one rank's heads
    from both) and receive their halves of the pushed and pulled blocks. The same at TP 1
    on both sides, one rank lending: tests/nats/test_prefix_fetch.py, and the lane's
    bench-multiturn with --fetch on."""
    async with running_rig(tmp_path_factory.mktemp("prefix"), model_dir, prompts.MAX_MODEL_LEN,
                           worker_tp={"decode-0": 2}) as rig:
        registrations, sub = await rig.observe("prefill", wire.KV_CONTROL.partly(engine_id="prefill-0"),
                                               wire.KvControl)
        rig.registrations = registrations
        yield rig
        await sub.unsubscribe()


async def _serve(rig, reference, name: str, mode: str) -> wire.Registration | None:
    """Send the case; its output must equal the reference. Push: decode's registration."""
    index = CASES[name]
    outcome = await rig.request({"prompt_token_ids": prompts.PREFIX_CASES[index][1],
                                 "max_tokens": prompts.PREFIX_MAX_TOKENS, "transfer_mode": mode,
                                 "request_id": f"prefix-{name}"})
    assert isinstance(outcome.final, wire.FinalReply), (name, outcome.final)
    assert outcome.tokens == reference[prompts.PREFIX + index], name
    prompt_tokens = len(prompts.PREFIX_CASES[index][1])
    path = rig.last_path = outcome.final.path
    assert (path.mode, path.chosen_by, path.prompt_tokens, path.attempt, path.recomputed_tokens) == (
        mode, "request", prompt_tokens, 1, 0), name
    if mode == "local":  # decode computed what its prefix cache lacked; nothing came from prefill
        assert (path.prefill_worker, path.prefill_computed_tokens, path.received_tokens) == ("", 0, 0), name
        assert path.decode_cached_tokens + path.decode_computed_tokens == prompt_tokens, name
        return None
    # Prefill computed what its cache lacked (its count is usage's cached_tokens) and it did
    # not fetch from the engine holding more of it; decode received the blocks its own cache lacked.
    assert path.prefill_computed_tokens == prompt_tokens - outcome.final.usage.cached_tokens - path.fetched_tokens, \
        name
    assert path.fetched_tokens % BLOCK == 0 and (path.fetched_tokens > 0) == (path.prefix_source == "fetched"), name
    assert path.decode_computed_tokens == 0 and path.decode_cached_tokens % BLOCK == 0, name
    assert path.received_tokens == prompt_tokens - path.decode_cached_tokens, name
    assert path.received_blocks == _prompt_blocks(name) - path.decode_cached_tokens // BLOCK, name
    if mode != "push":
        return None
    mine = [r for r in rig.registrations if isinstance(r, wire.Registration) and r.request_id == outcome.request_id]
    assert len(mine) >= 1, f"{name}: no registration seen"
    # The report's numbers are the registration's: the blocks decode named, after its own cache's.
    assert (path.decode_cached_tokens, path.received_blocks) == (mine[0].first_block * BLOCK,
                                                                 len(mine[0].block_ids)), name
    written = await wait_until(lambda: rig.written_bytes.get(mine[0].transfer_id), 10, "the write's report")
    assert path.received_bytes == written, name  # what prefill's WRITE moved
    return mine[0]


def _prompt_blocks(name: str) -> int:
    return -(-len(prompts.PREFIX_CASES[CASES[name]][1]) // BLOCK)


async def test_no_shared_prefix(rig, reference):
    registration = await _serve(rig, reference, "no-shared-prefix", "push")
    assert registration.first_block == 0
    assert len(registration.block_ids) == _prompt_blocks("no-shared-prefix")


async def test_a_prefix_cached_on_decode_only(rig, reference):
    await _serve(rig, reference, "warm-decode", "local")  # decode computes it: prefill never sees it
    await wait_until(lambda: rig.cached_blocks_known("decode-0", prompts.PREFIX_CASES[CASES["warm-decode"]][1]) >= 5,
                     10, "decode's cached blocks relayed")
    registration = await _serve(rig, reference, "cached-on-decode-only", "push")
    assert registration.first_block == 4  # 512 tokens of OTHER decode holds
    # Prefill READ those 512 tokens from decode's prefix cache (decode lent its blocks) and
    # computed the rest; decode got pushed the blocks it lacked. Checked in _serve: the output
    # equals the single engine's, and prefill computed only what it neither held nor fetched.
    path = rig.last_path
    assert (path.prefix_source, path.fetched_tokens, path.fetched_from) == ("fetched", 512, "decode-0")
    assert path.prefill_computed_tokens == len(prompts.PREFIX_CASES[CASES["cached-on-decode-only"]][1]) - 512
    assert len(registration.block_ids) == _prompt_blocks("cached-on-decode-only") - 4
    await _serve(rig, reference, "pulled-with-a-decode-hit", "pull")  # decode READs only the blocks it lacks


async def test_a_prefix_cached_on_prefill_only(rig, reference):
    await rig.kill_and_replace("decode")  # a fresh engine: an empty cache
    registration = await _serve(rig, reference, "cached-on-prefill-only", "push")
    assert registration.first_block == 0  # prefill computed only the suffix, and pushes every block


async def test_a_prefix_cached_on_both_with_different_lengths(rig, reference):
    registration = await _serve(rig, reference, "cached-on-both-prefill-longer", "push")
    assert registration.first_block == 3  # decode: 3 blocks of SHARED; prefill: 5
    await _serve(rig, reference, "warm-decode-longer", "local")
    registration = await _serve(rig, reference, "cached-on-both-decode-longer", "push")
    assert registration.first_block == 6  # decode: 6 blocks of OTHER; prefill: 4


async def _lend(rig, holder: str, prompt: list[int], blocks: int) -> wire.Lent:
    """Ask ``holder`` to lend ``prompt``'s first ``blocks`` blocks, as a scheduler does."""
    job = wire.LendJob(request_id="lend-probe", transfer_id=uuid.uuid4().hex, prompt_token_ids=prompt[:blocks * BLOCK + 1],
                       blocks=blocks, reader_engine_id="prefill-0", transfer_key=uuid.uuid4().hex)
    reply = await rig.conns["scheduler"].request(wire.LEND_JOBS(worker_id=holder), wire.encode(job), timeout=10)
    lent = wire.decode(reply.data, wire.Lent)
    assert (lent.transfer_id, lent.holder_engine_id) == (job.transfer_id, holder)
    return lent


async def test_a_lend_of_a_prefix_the_engine_does_not_hold_is_refused_before_anything_runs(rig):
    """A prefix decode's cache never held (or has evicted): refused as prefix_not_held, no
    blocks named, nothing run on its engine. One it holds is lent: its blocks, all found in
    its cache; nobody reads them here, so its lease runs out and they come back (checked
    with every other block at the end, in test_a_prefix_ending_mid_block)."""
    unheld = await _lend(rig, "decode-0", prompts.token_prompt(5 * BLOCK, 4343), 4)
    assert unheld.error is not None and unheld.error.code == "prefix_not_held", unheld
    assert unheld.kv_transfer_params is None
    held = await _lend(rig, "decode-0", prompts.PREFIX_CASES[CASES["warm-decode-longer"]][1], 6)
    assert held.error is None, held.error
    lent = wire.PrefilledKv.of(held.kv_transfer_params)
    assert len(lent.remote_block_ids) == 7 and held.cached_tokens == 6 * BLOCK  # the 6 blocks were cache hits


async def test_a_prefix_ending_mid_block(rig, reference):
    for name in ("prefix-ending-mid-block", "same-prefix-ending-mid-block"):
        registration = await _serve(rig, reference, name, "push")
        assert registration.first_block == 1  # 200 shared tokens: one whole block is cached
    await rig.assert_blocks_back()
    rig.assert_nothing_else_died()


async def test_both_engines_relay_what_their_prefix_caches_stored_keyed_as_schedulers_key_prompts(rig):
    """vLLM's KV cache events, from each engine's own ZMQ socket onto NATS by its worker
    (services/worker/cache_relay.py): the blocks prefill computed and decode received carry
    the keys a scheduler computes for the prompt. Routing by them: tests/nats/test_scheduler.py."""
    events, sub = await rig.observe("scheduler", wire.CACHE_EVENTS.wildcard, wire.CacheEvents)
    prompt = prompts.token_prompt(5 * BLOCK + 30, 4242)  # cached nowhere yet
    try:
        outcome = await rig.request({"prompt_token_ids": prompt, "max_tokens": 4, "transfer_mode": "push",
                                     "request_id": "prefix-relayed"})
        assert isinstance(outcome.final, wire.FinalReply), outcome.final
        wanted = set(block_keys(prompt, BLOCK))

        def stored_by(worker_id: str) -> set[bytes]:
            return {key for e in events if e.worker_id == worker_id for key in e.stored}

        await wait_until(lambda: wanted <= stored_by("prefill-0") and wanted <= stored_by("decode-0"), 30,
                         "both engines' stored blocks relayed")
    finally:
        await sub.unsubscribe()
    incarnations = {e.worker_id: e.incarnation for e in events}
    live = rig.live_incarnations("prefill") | rig.live_incarnations("decode")
    assert {(w, i) for w, i in incarnations.items()} <= live  # each relays as the start it is
