"""Layer-wise push's bookkeeping (connector/layer_writes.py): which layers may be posted
when, and how the transfer ends, whatever order the forward, the peer's agent, a Revoke
and the layers' ends come in."""

from __future__ import annotations

import pytest

from kvpush.connector.layer_writes import LayerState, LayerWrites, NotWritten, Written


def test_layers_go_as_they_are_computed_once_the_peer_is_known():
    writes = LayerWrites(4)
    assert writes.layer_computed(0) == []  # the peer's agent is not known yet
    assert writes.layer_computed(1) == []
    assert writes.peer_found() == [0, 1]  # what was computed meanwhile goes at once
    assert writes.layer_computed(2) == [2]
    assert writes.all_computed() == [3]
    assert writes.all_computed() == []  # each layer once


def test_the_transfer_is_written_only_when_every_layer_landed():
    writes = LayerWrites(3)
    writes.peer_found()
    writes.layer_computed(0)
    writes.layer_computed(1)
    assert writes.layer_ended(0, True, 100, 2) is None
    assert writes.layer_ended(1, True, 100, 2) is None  # layer 2 is not computed yet
    writes.all_computed()
    assert writes.layer_ended(2, True, 50, 1) == Written(250, 5)
    assert writes.outcome() is None  # told once


def test_a_stop_between_layers_posts_nothing_more_and_ends_once_the_posted_ones_landed():
    writes = LayerWrites(4)
    writes.peer_found()
    assert writes.layer_computed(1) == [0, 1]
    writes.stop("revoked")
    assert writes.layer_computed(2) == [] and writes.all_computed() == []
    assert writes.outcome() is None  # two layers still in flight: they may still land
    assert writes.layer_ended(0, True, 10, 1) is None
    assert writes.layer_ended(1, True, 10, 1) == NotWritten(stopped=True, reason="revoked", layers_landed=2)
    assert writes.states == [LayerState.LANDED, LayerState.LANDED, LayerState.WAITING, LayerState.WAITING]


def test_a_stop_with_nothing_in_flight_ends_at_once():
    writes = LayerWrites(2)
    writes.layer_computed(0)  # the peer not known: nothing posted
    writes.stop("revoked")
    assert writes.outcome() == NotWritten(stopped=True, reason="revoked", layers_landed=0)


def test_a_failed_layer_stops_the_rest_and_fails_the_transfer():
    writes = LayerWrites(3)
    writes.peer_found()
    writes.layer_computed(1)
    assert writes.layer_ended(0, False, error="peer gone") is None  # layer 1 still in flight
    assert writes.all_computed() == []
    end = writes.layer_ended(1, True, 10, 1)
    assert end == NotWritten(stopped=False, reason="layer 0: peer gone", layers_landed=1)


def test_a_layer_can_end_only_once_and_only_after_it_was_posted():
    writes = LayerWrites(2)
    with pytest.raises(ValueError, match="waiting"):
        writes.layer_ended(0, True)
    writes.peer_found()
    writes.layer_computed(0)
    writes.layer_ended(0, True)
    with pytest.raises(ValueError, match="landed"):
        writes.layer_ended(0, True)
