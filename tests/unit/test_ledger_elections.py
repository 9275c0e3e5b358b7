"""kvpush.services.ledger.through_elections: a JetStream write that met no leader (the server
leading its bucket died; the others are electing one) did not land, so it is sent again
until the election is over; anything else is the caller's to handle, at once."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from kvpush.services import ledger


def calls_failing(errors: list[Exception], result="written"):
    made = []

    async def call():
        made.append(1)
        if len(made) <= len(errors):
            raise errors[len(made) - 1]
        return result

    return call, made


async def test_a_write_without_a_leader_is_sent_again_until_one_is_elected():
    call, made = calls_failing([nats.js.errors.NoStreamResponseError(), nats.errors.NoRespondersError(),
                                nats.js.errors.ServiceUnavailableError()])
    assert await ledger.through_elections(call, within_s=5) == "written"
    assert len(made) == 4


async def test_an_election_longer_than_the_budget_is_said():
    call, made = calls_failing([nats.js.errors.NoStreamResponseError()] * 1000)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await ledger.through_elections(call, within_s=0.3)
    assert 2 <= len(made) < 20  # backed off, not spun


async def test_a_write_that_may_have_landed_is_not_sent_again():
    for error in (nats.js.errors.KeyWrongLastSequenceError(), nats.errors.TimeoutError()):
        call, made = calls_failing([error])
        with pytest.raises(type(error)):
            await ledger.through_elections(call, within_s=5)
        assert len(made) == 1
