"""What a migrated request's new decode sends of its engine's outputs when the engine
replays the tokens the client already has (services/worker/decode.py ``_unreplayed``)."""

from __future__ import annotations

from types import SimpleNamespace

from kvpush.services.worker.decode import _Stream, _unreplayed
from kvpush.shared import wire

WORDS = {1: "a", 2: " b", 3: " c", 4: " d", 5: " e"}


def _text(token_ids: list[int]) -> str:
    return "".join(WORDS[t] for t in token_ids)


def _output(token_ids: list[int]):
    return SimpleNamespace(token_ids=token_ids, text=_text(token_ids), logprobs=[[t] for t in token_ids])


def test_replayed_outputs_are_dropped_and_a_straddling_one_keeps_only_its_new_tokens_text():
    resume = wire.Resume(token_ids=[1, 2, 3], chunks=3, first_token_at=1.0, continuation="replay")
    stream = _Stream.resuming(resume)
    assert (stream.chunks, stream.completion_tokens, stream.replay_left) == (3, 3, 3)
    replayed = resume.token_ids
    assert _unreplayed(stream, 0, _output([1]), replayed, _text) == ([], "", None)
    # two steps in one output: the replay's last token and the first new one
    assert _unreplayed(stream, 0, _output([2, 3, 4]), replayed, _text) == ([4], " d", [[4]])
    assert _unreplayed(stream, 0, _output([5]), replayed, _text) == ([5], " e", [[5]])  # past the replay: as is


def test_a_reprefill_or_a_fresh_request_replays_nothing():
    for resume in (None, wire.Resume(token_ids=[1, 2], chunks=2, first_token_at=1.0, continuation="reprefill")):
        stream = _Stream.resuming(resume)
        assert stream.replay_left == 0
        assert _unreplayed(stream, 0, _output([3]), [], _text) == ([3], " c", [[3]])
