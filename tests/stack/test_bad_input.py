"""Bad requests on kvpush.generate get a final error with a code and a sentence, and
the stack serves the next request normally."""

from __future__ import annotations

import json

import pytest

from services.cli.client import generate_all
from tests import prompts

pytestmark = pytest.mark.timeout(600)

GOOD = {"prompt_token_ids": prompts.token_prompt(20, 77), "max_tokens": 4, "ignore_eos": True}

BAD = [
    ("not-json", b"{this is not json", "bad_json"),
    ("not-an-object", b"[1, 2, 3]", "invalid_field"),
    ("unknown-field", {"prompt": "hi", "max_tokenz": 3}, "invalid_field"),
    ("empty-prompt", {"prompt": ""}, "empty_prompt"),
    ("empty-token-ids", {"prompt_token_ids": []}, "empty_prompt"),
    ("no-prompt", {"max_tokens": 3}, "empty_prompt"),
    ("both-prompts", {"prompt": "a", "prompt_token_ids": [1]}, "invalid_field"),
    ("too-long", {"prompt_token_ids": prompts.token_prompt(prompts.MAX_MODEL_LEN + 10, 5)}, "prompt_too_long"),
    ("exactly-the-context", {"prompt_token_ids": prompts.token_prompt(prompts.MAX_MODEL_LEN, 5)}, "prompt_too_long"),
    ("max-tokens-zero", {"prompt": "hi", "max_tokens": 0}, "invalid_field"),
    ("max-tokens-negative", {"prompt": "hi", "max_tokens": -3}, "invalid_field"),
    ("max-tokens-string", {"prompt": "hi", "max_tokens": "ten"}, "invalid_field"),
    ("max-tokens-float", {"prompt": "hi", "max_tokens": 2.5}, "invalid_field"),
    ("prompt-number", {"prompt": 5}, "invalid_field"),
    ("token-ids-strings", {"prompt_token_ids": ["a", "b"]}, "invalid_field"),
    ("token-id-out-of-vocab", {"prompt_token_ids": [1, prompts.VOCAB + 5]}, "invalid_field"),
    ("negative-temperature", {"prompt": "hi", "temperature": -1}, "invalid_field"),
    ("ignore-eos-string", {"prompt": "hi", "ignore_eos": "yes"}, "invalid_field"),
]


@pytest.mark.parametrize("name,body,code", BAD, ids=[b[0] for b in BAD])
async def test_bad_request_gets_an_error_and_the_next_request_is_served(stack, nc, name, body, code):
    data = body if isinstance(body, bytes) else json.dumps({**body, "request_id": name}).encode()
    token_ids, _, final = await generate_all(nc, data, timeout=30)
    assert token_ids == []
    assert final["finished"] is True
    assert final["error"]["code"] == code, final
    message = final["error"]["message"]
    assert len(message) > 10 and message[0].isalpha(), message
    if not isinstance(body, bytes):
        assert final["request_id"] == name

    token_ids, _, final = await generate_all(nc, GOOD, timeout=60)
    assert "error" not in final
    assert len(token_ids) == 4
