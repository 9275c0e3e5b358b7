"""The fault suite's named points (shared/chaos.py): ``kv.flip`` corrupts every decode rank's
landed KV, ``kv.flip.<rank>`` only that rank's, ``kv.write.<rank>`` fails that prefill rank's
WRITEs; each logs what it did, and a point with no rates does nothing."""

from __future__ import annotations

from kvpush.shared.chaos import Chaos, Rates


def test_a_flip_named_for_one_rank_corrupts_only_that_ranks_blocks(tmp_path):
    log = tmp_path / "chaos.log"
    chaos = Chaos({"kv.flip.1": Rates(flip=1.0)}, seed=1, log_path=str(log))
    assert chaos.flips("t-0", rank=0) is None
    assert isinstance(chaos.flips("t-0", rank=1), int)
    assert log.read_text().split() == ["flip", "t-0"]


def test_an_unnamed_flip_corrupts_every_rank_and_no_rates_none():
    assert all(isinstance(Chaos({"kv.flip": Rates(flip=1.0)}).flips("t", rank=r), int) for r in (0, 1))
    assert Chaos({}).flips("t", rank=0) is None
    write = Chaos({"kv.write.1": Rates(drop=1.0)})
    assert (write.drops("kv.write.0"), write.drops("kv.write.1")) == (False, True)
