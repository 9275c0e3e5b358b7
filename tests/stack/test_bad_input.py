"""Bad requests on kvpush.generate, through the real transport to the real scheduler: a
final error with a code and a sentence, and the stack serves the next request normally.

Only what needs the NATS path is here: raw bodies that are not JSON or not an object (no
client library would send them), the request_id echoed in the reply, and one case of each
code against the limits the stack's scheduler read from the model folder. Every other
case is in tests/unit/test_validation.py, against RequestValidator with the same codes."""

from __future__ import annotations

import json

import pytest

from kvpush.client import generate_all
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(600)

GOOD = {"prompt_token_ids": prompts.token_prompt(20, 77), "max_tokens": 4, "ignore_eos": True}

BAD = [
    ("not-json", b"{this is not json", "bad_json"),
    ("not-an-object", b"[1, 2, 3]", "invalid_field"),
    ("empty-prompt", {"prompt": ""}, "empty_prompt"),
    ("token-id-out-of-vocab", {"prompt_token_ids": [1, prompts.VOCAB]}, "invalid_field"),
    ("exactly-the-context", {"prompt_token_ids": prompts.token_prompt(prompts.MAX_MODEL_LEN, 5)}, "prompt_too_long"),
]


@pytest.mark.parametrize("name,body,code", BAD, ids=[b[0] for b in BAD])
async def test_bad_request_gets_an_error_and_the_next_request_is_served(stack, nc, name, body, code):
    data = body if isinstance(body, bytes) else json.dumps({**body, "request_id": name}).encode()
    token_ids, _, final = await generate_all(nc, data, timeout=30)
    assert token_ids == []
    assert isinstance(final, wire.ErrorReply) and final.finished is True
    assert final.error.code == code, final
    message = final.error.message
    assert len(message) > 10 and message[0].isalpha(), message
    assert final.request_id == ("" if isinstance(body, bytes) else name)

    token_ids, _, final = await generate_all(nc, GOOD, timeout=60)
    assert isinstance(final, wire.FinalReply), final
    assert len(token_ids) == 4
