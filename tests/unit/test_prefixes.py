"""Which worker holds which prompt prefix: the block keys every process computes
(shared/block_keys.py), the worker's keying of vLLM's KV cache events
(services/worker/cache_keys.py) and their messages (cache_relay.messages), the
scheduler's index of them (services/scheduler/prefixes.py), and the picks that prefer
it (routing.WorkerPool)."""

from __future__ import annotations

from kvpush.services.scheduler.placement import PromptLoad
from kvpush.services.scheduler.prefixes import PrefixIndex, Prompt
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.worker.cache_keys import CacheKeys
from kvpush.services.worker.cache_relay import messages
from kvpush.shared import wire
from kvpush.shared.block_keys import block_keys, next_key

BLOCK = 4


def test_a_block_key_covers_every_token_before_it():
    a, b = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK), block_keys([1, 2, 3, 4, 5, 6, 7, 0], BLOCK)
    assert len(a) == 2 and len(b) == 2  # whole blocks only: the 9th token is in no key
    assert a[0] == b[0] and a[1] != b[1]
    assert block_keys([9, 2, 3, 4, 5, 6, 7, 8], BLOCK)[1] != a[1]  # same second block, other first


def test_a_block_key_is_made_from_its_parent_key_and_its_own_tokens():
    keys = block_keys(list(range(12)), BLOCK)
    assert keys[1] == next_key(keys[0], [4, 5, 6, 7])
    assert block_keys(list(range(4, 12)), BLOCK, parent=keys[0]) == keys[1:]


def test_the_index_counts_the_leading_blocks_a_worker_stored():
    index = PrefixIndex()
    index.stored("d-0", "i1", block_keys(list(range(12)), BLOCK))
    assert index.cached_blocks("d-0", block_keys(list(range(10)), BLOCK)) == 2
    assert index.cached_blocks("d-0", block_keys([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], BLOCK)) == 1
    assert index.cached_blocks("d-1", block_keys(list(range(12)), BLOCK)) == 0
    index.forget("d-0")
    assert index.cached_blocks("d-0", block_keys(list(range(12)), BLOCK)) == 0


def _beat(worker_id: str, role: str, incarnation: str = "i1", running: int = 0, **fields) -> wire.WorkerHeartbeat:
    return wire.WorkerHeartbeat(worker_id=worker_id, role=role, free_kv_blocks=1000, total_kv_blocks=1000,
                                running=running, waiting=0, block_size=BLOCK, max_model_len=4096,
                                incarnation=incarnation, **fields)


def _stored(worker_id: str, token_ids: list[int], incarnation: str = "i1") -> wire.CacheEvents:
    return wire.CacheEvents(worker_id=worker_id, incarnation=incarnation, stored=block_keys(token_ids, BLOCK))


def test_the_next_turn_goes_to_the_decode_and_prefill_that_hold_the_last_one():
    pool = WorkerPool()
    for beat in (_beat("p-0", "prefill"), _beat("p-1", "prefill"), _beat("d-0", "decode"), _beat("d-1", "decode")):
        pool.observe(beat, now=0.0)
    first_turn = list(range(40))
    answer = list(range(900, 908))
    pool.cache_events(_stored("p-1", first_turn))  # p-1 computed the first turn, d-1 holds it and its answer
    pool.cache_events(_stored("d-1", first_turn + answer))
    next_turn = first_turn + answer + list(range(500, 520))
    assert pool.prefill_load(1.1, Prompt(next_turn)).cached_tokens == 40
    assert pool.decode_load(68, 1.1, Prompt(next_turn)).cached_tokens == 48
    assert [b.worker_id for b in pool.pick(68, now=1.1, prompt=Prompt(next_turn))] == ["p-1", "d-1"]
    nobody_holds = Prompt(list(range(1000, 1068)))
    assert [b.worker_id for b in pool.pick(68, now=1.1, prompt=nobody_holds)] == ["p-0", "d-0"]


def test_evicted_blocks_no_longer_attract_the_prompt():
    pool = WorkerPool()
    pool.observe(_beat("d-0", "decode"), now=0.0)
    prompt = Prompt(list(range(40)))
    pool.cache_events(_stored("d-0", prompt.token_ids))
    pool.cache_events(wire.CacheEvents(worker_id="d-0", incarnation="i1", removed=prompt.keys(BLOCK)[3:4]))
    assert pool.cached_tokens("d-0", prompt) == 3 * BLOCK  # the blocks after an evicted one do not count
    pool.cache_events(wire.CacheEvents(worker_id="d-0", incarnation="i1", cleared=True))
    assert pool.cached_tokens("d-0", prompt) == 0


def test_a_held_prefix_does_not_outweigh_a_busier_decode():
    pool = WorkerPool(prefix_weight=1.0)
    pool.observe(_beat("p-0", "prefill"), now=0.0)
    pool.observe(_beat("d-0", "decode", running=3), now=0.0)
    pool.observe(_beat("d-1", "decode"), now=0.0)
    prompt = Prompt(list(range(40)))
    pool.cache_events(_stored("d-0", prompt.token_ids))
    assert pool.pick_decode(40, now=0.1, prompt=prompt).worker_id == "d-1"  # 3 running - 1 > 0 running
    pool.observe(_beat("d-0", "decode", running=0), now=0.2)
    pool.observe(_beat("d-1", "decode", running=0), now=0.2)
    assert pool.pick_decode(40, now=0.3, prompt=prompt).worker_id == "d-0"  # equal load: the one holding it


def test_a_restarted_worker_holds_nothing():
    pool = WorkerPool()
    pool.observe(_beat("d-0", "decode"), now=0.0)
    prompt = Prompt(list(range(40)))
    pool.cache_events(_stored("d-0", prompt.token_ids))
    pool.observe(_beat("d-0", "decode", incarnation="i2"), now=1.0)
    assert pool.cached_tokens("d-0", prompt) == 0
    pool.cache_events(wire.CacheEvents(worker_id="d-0", incarnation="i2", stored=prompt.keys(BLOCK)[:2]))
    pool.cache_events(_stored("d-0", prompt.token_ids, incarnation="i1"))  # late, from the start before
    assert pool.cached_tokens("d-0", prompt) == 2 * BLOCK
    pool.cache_events(_stored("d-9", prompt.token_ids))  # no heartbeat yet: nothing it says is kept
    pool.observe(_beat("d-9", "decode"), now=1.0)
    assert pool.cached_tokens("d-9", prompt) == 0


def test_a_prefill_that_holds_the_prompt_finishes_it_sooner():
    assert PromptLoad(1000, 1000.0, cached_tokens=800).finish_s(1000) == 1.2
    assert PromptLoad(1000, 1000.0).finish_s(1000) == 2.0


def test_a_decode_with_requests_queued_while_another_has_none_is_overloaded():
    pool = WorkerPool()
    pool.observe(wire.WorkerHeartbeat(worker_id="d-0", role="decode", free_kv_blocks=10, total_kv_blocks=10,
                                      running=16, waiting=5, block_size=BLOCK, max_model_len=4096), now=0.0)
    assert not pool.overloaded("d-0", now=0.1)  # no other decode to move to
    pool.observe(_beat("d-1", "decode"), now=0.0)
    assert pool.overloaded("d-0", now=0.1) and not pool.overloaded("d-1", now=0.1)
    assert pool.pick_decode(40, now=0.1, exclude="d-1").worker_id == "d-0"
    assert pool.pick_decode(40, now=0.1, exclude="d-0").worker_id == "d-1"


# ---------------------------------------------------------------------- vLLM's events, keyed


class BlockStored:  # the fields of vllm.distributed.kv_events.BlockStored that keys need
    def __init__(self, block_hashes, parent_block_hash, token_ids, block_size=BLOCK, **rest):
        self.block_hashes, self.parent_block_hash = block_hashes, parent_block_hash
        self.token_ids, self.block_size = token_ids, block_size
        self.medium, self.group_idx, self.lora_name, self.extra_keys = "GPU", 0, None, None
        self.__dict__.update(rest)


class BlockRemoved:
    def __init__(self, block_hashes):
        self.block_hashes, self.medium, self.group_idx = block_hashes, "GPU", 0


class AllBlocksCleared:
    pass


def test_blocks_vllm_stores_step_by_step_get_the_keys_a_scheduler_computes_for_the_prompt():
    prompt = list(range(14))  # three whole blocks and two tokens
    keys = CacheKeys(BLOCK)
    first = keys.apply([BlockStored([101, 102], None, prompt[:8])])
    second = keys.apply([BlockStored([103], 102, prompt[8:12])])
    assert list(first.stored) + list(second.stored) == block_keys(prompt, BLOCK)
    removed = keys.apply([BlockRemoved([102]), BlockRemoved([999])])  # one it never heard of
    assert list(removed.removed) == [block_keys(prompt, BLOCK)[1]] and not removed.stored
    assert len(keys) == 2


def test_blocks_it_cannot_key_by_tokens_alone_are_left_out():
    keys = CacheKeys(BLOCK)
    assert not keys.apply([BlockStored([1], 77, [1, 2, 3, 4])])  # its parent came before we listened
    assert not keys.apply([BlockStored([2], None, [1, 2, 3, 4], lora_name="adapter")])
    assert not keys.apply([BlockStored([3], None, [1, 2, 3, 4], group_idx=1)])
    assert not keys.apply([BlockStored([4], None, [1, 2], block_size=2)])  # another granularity
    mixed = keys.apply([BlockStored([5, 6], None, list(range(8)), extra_keys=[None, ("mm", 0)])])
    assert list(mixed.stored) == block_keys(list(range(4)), BLOCK)  # up to the first with extra keys
    assert len(keys) == 1


def test_a_batch_says_its_net_effect_and_a_clear_drops_what_came_before_it():
    keys = CacheKeys(BLOCK)
    keys.apply([BlockStored([1], None, [1, 2, 3, 4])])
    changes = keys.apply([BlockRemoved([1]), BlockStored([2], None, [1, 2, 3, 4]),  # evicted, then stored again
                          BlockStored([3], None, [5, 6, 7, 8]), BlockRemoved([3])])  # stored, then evicted
    assert list(changes.stored) == block_keys([1, 2, 3, 4], BLOCK) and list(changes.removed) == block_keys(
        [5, 6, 7, 8], BLOCK)
    cleared = keys.apply([BlockStored([4], None, [9, 9, 9, 9]), AllBlocksCleared(), BlockStored([5], None, [7] * 4)])
    assert cleared.cleared and list(cleared.stored) == block_keys([7] * 4, BLOCK) and not cleared.removed
    assert len(keys) == 1


def test_changes_go_out_in_messages_the_wire_accepts():
    many = {bytes([i % 256, i // 256]) * 8: None for i in range(wire.MAX_CACHE_KEYS + 10)}
    changes = CacheKeys(BLOCK).apply([])
    changes.stored, changes.removed, changes.cleared = dict(many), {b"r" * 16: None}, True
    out = messages("d-0", "i1", changes)
    assert [(len(m.removed), len(m.stored), m.cleared) for m in out] == [(1, 0, True), (0, wire.MAX_CACHE_KEYS, False),
                                                                        (0, 10, False)]
    for message in out:
        assert wire.decode(wire.encode(message), wire.CacheEvents) == message
    assert messages("d-0", "i1", CacheKeys(BLOCK).apply([AllBlocksCleared()]))[0].cleared


def test_a_worker_that_reports_more_blocks_than_its_engine_has_pushes_out_only_its_own():
    pool = WorkerPool()
    pool.observe(_beat("d-0", "decode"), now=0.0)  # 1000 blocks
    pool.observe(_beat("d-9", "decode"), now=0.0)
    prompt = Prompt(list(range(40)))
    pool.cache_events(_stored("d-0", prompt.token_ids))
    junk = [bytes([i % 256, i // 256]) * 8 for i in range(3000)]
    for start in range(0, len(junk), 1000):
        pool.cache_events(wire.CacheEvents(worker_id="d-9", incarnation="i1", stored=junk[start:start + 1000]))
    assert len(pool.prefixes) == 10 + 1000
    assert pool.cached_tokens("d-0", prompt) == 40 // BLOCK * BLOCK


def test_past_its_bound_the_index_drops_the_oldest_of_the_worker_holding_most():
    index = PrefixIndex(max_blocks=6)
    small, big = block_keys(list(range(8)), BLOCK), block_keys(list(range(100, 120)), BLOCK)
    index.stored("d-0", "i1", small)
    index.stored("d-1", "i1", big)  # 2 + 5 blocks: d-1's oldest goes
    assert len(index) == 6
    assert index.cached_blocks("d-0", small) == 2 and index.cached_blocks("d-1", big[1:]) == 4
    assert index.cached_blocks("d-1", big) == 0  # its first block went: the rest is not a prefix
    index.removed("d-1", "i1", big[-1:] + big[-1:])  # twice: counted once
    assert len(index) == 5
