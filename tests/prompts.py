"""Prompts the end-to-end tests send, shared so the reference engine runs once."""

from __future__ import annotations

import random

BLOCK_SIZE = 128  # vLLM's CPU default
MAX_MODEL_LEN = 2048
VOCAB = 4096


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


# (name, prompt token ids, max_tokens): lengths around block boundaries and the context.
CORRECTNESS = [
    ("shorter-than-a-block", token_prompt(5, 1), 24),
    ("one-token-short-of-a-block", token_prompt(BLOCK_SIZE - 1, 2), 24),
    ("exactly-one-block", token_prompt(BLOCK_SIZE, 3), 24),
    ("one-block-and-one-token", token_prompt(BLOCK_SIZE + 1, 4), 24),
    ("many-blocks-not-a-multiple", token_prompt(1000, 5), 24),
    ("exactly-eight-blocks", token_prompt(8 * BLOCK_SIZE, 6), 24),
    ("long", token_prompt(1700, 7), 24),
    ("near-the-context", token_prompt(MAX_MODEL_LEN - 8, 8), 8),
    ("single-token", token_prompt(1, 9), 24),
]

# The KV of PUSHED is written into decode's blocks for TARGET: same length, same last
# token (decode recomputes the last prompt position itself), different everything else.
CROSS_LENGTH = 300
CROSS_TARGET = token_prompt(CROSS_LENGTH, 100)
CROSS_PUSHED = token_prompt(CROSS_LENGTH - 1, 101) + [CROSS_TARGET[-1]]

ORDER_PROMPT = token_prompt(400, 200)
CROSS_MAX_TOKENS = 24


# The fault suite streams this one long enough to restart NATS in the middle.
STREAM_PROMPT = token_prompt(600, 300)
STREAM_MAX_TOKENS = 150


# The prefix-caching suite: prompts that share a prefix of SHARED (or of OTHER), each with
# a tail of its own; (name, prompt), in the order the suite sends them.
SHARED = token_prompt(900, 400)
OTHER = token_prompt(900, 401)
PREFIX_MAX_TOKENS = 16


def _sharing(source: list[int], prefix_len: int, tail_seed: int, tail_len: int = 40) -> list[int]:
    return source[:prefix_len] + token_prompt(tail_len, tail_seed)


PREFIX_CASES = [
    ("no-shared-prefix", _sharing(SHARED, 700, 410)),  # the first: nothing cached anywhere
    ("warm-decode", _sharing(OTHER, 650, 411)),  # computed on decode alone (local)
    ("cached-on-decode-only", _sharing(OTHER, 600, 412)),  # decode holds 4 blocks, prefill none
    ("pulled-with-a-decode-hit", _sharing(OTHER, 620, 413)),
    ("cached-on-prefill-only", _sharing(SHARED, 500, 414)),  # after decode restarted: prefill holds 3
    ("cached-on-both-prefill-longer", _sharing(SHARED, 690, 415)),  # prefill 5 blocks, decode 3
    ("warm-decode-longer", _sharing(OTHER, 890, 416)),  # local: decode holds 7 blocks of OTHER
    ("cached-on-both-decode-longer", _sharing(OTHER, 880, 417)),  # decode 6 blocks, prefill 4
    ("prefix-ending-mid-block", _sharing(SHARED, 200, 418)),  # 1 block cached, 72 shared tokens are not
    ("same-prefix-ending-mid-block", _sharing(SHARED, 200, 419)),
]


# Sampled, not greedy: each of these with SEEDED_SAMPLING must give the single engine's
# tokens in every mode (the seed makes a sample repeatable); lengths below, at and across
# block boundaries, up to most of the context.
SEEDED_SAMPLING = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
SEEDED = [token_prompt(n, 500 + i) for i, n in enumerate(
    [1, 3, 17, 64, 127, 128, 129, 200, 255, 256, 300, 384, 500, 640, 700, 900, 1024, 1100, 1300, 1800])]
SEEDED_MAX_TOKENS = 16


# Each token's logprob and the 5 most likely, greedy and sampled: within 1e-4 of the
# single engine's, in every mode.
LOGPROBS = [(token_prompt(40, 600), {"logprobs": 5}), (token_prompt(300, 601), {"logprobs": 5}),
            (token_prompt(700, 602), {**SEEDED_SAMPLING, "logprobs": 3})]
LOGPROBS_MAX_TOKENS = 8


def reference_requests() -> list[dict]:
    requests = [{"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True} for _, p, n in CORRECTNESS]
    for prompt in (CROSS_TARGET, CROSS_PUSHED, ORDER_PROMPT):
        requests.append({"prompt_token_ids": prompt, "max_tokens": CROSS_MAX_TOKENS, "ignore_eos": True})
    requests.append({"prompt_token_ids": STREAM_PROMPT, "max_tokens": STREAM_MAX_TOKENS, "ignore_eos": True})
    for _, prompt in PREFIX_CASES:
        requests.append({"prompt_token_ids": prompt, "max_tokens": PREFIX_MAX_TOKENS, "ignore_eos": True})
    for sampling in (SEEDED_SAMPLING, {**SEEDED_SAMPLING, "seed": 8}, {}):  # seed 7, seed 8, greedy
        for prompt in SEEDED:
            requests.append({"prompt_token_ids": prompt, "max_tokens": SEEDED_MAX_TOKENS, "ignore_eos": True,
                             **sampling})
    for prompt, sampling in LOGPROBS:
        requests.append({"prompt_token_ids": prompt, "max_tokens": LOGPROBS_MAX_TOKENS, "ignore_eos": True,
                         **sampling})
    requests.append({"prompt_token_ids": N_PROMPT, "max_tokens": SEEDED_MAX_TOKENS, "ignore_eos": True,
                     **N_SAMPLING})
    return requests


PREFIX = len(CORRECTNESS) + 4  # the first of PREFIX_CASES in the reference
SEEDED_AT = PREFIX + len(PREFIX_CASES)  # SEEDED with seed 7, then with seed 8, then greedy
LOGPROBS_AT = SEEDED_AT + 3 * len(SEEDED)
N_AT = LOGPROBS_AT + len(LOGPROBS)  # N_PROMPT's n answers: a list of n lists


# n = 4 answers from one prompt, seeded: vLLM samples answer i with seed + i. Several
# blocks long, so that the answers after the first find most of it in decode's cache.
N_PROMPT = token_prompt(700, 700)
N_SAMPLING = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "n": 4}


# The gateway's chat test: its reference is these messages through the model's chat
# template (as the gateway renders them), run on one plain vLLM instance.
CHAT_MESSAGES = [{"role": "system", "content": "You write Python."},
                 {"role": "user", "content": "def parse_args(argv):"}]
CHAT_MAX_TOKENS = 24
CHAT = len(reference_requests())  # its index in the reference


def chat_reference_request(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from kvpush.services.gateway.prompts import chat_prompt

    ids = chat_prompt(AutoTokenizer.from_pretrained(model_dir), CHAT_MESSAGES)
    return {"prompt_token_ids": ids, "max_tokens": CHAT_MAX_TOKENS, "ignore_eos": True}
