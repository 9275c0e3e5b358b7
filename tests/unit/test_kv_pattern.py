"""The stand-in forward's arithmetic (tools/emulation/kv_pattern.py): a token's KV pattern is
exact in float32 and depends on the token and its position; the next token depends on every
value the step read, and stays above the special ids."""

from __future__ import annotations

import torch

from kvpush.tools.emulation.kv_pattern import FIRST_TOKEN, PATTERN_MODULUS, next_tokens, token_pattern


def test_a_tokens_pattern_depends_on_its_id_and_position_and_is_a_small_integer():
    ids, positions = torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0])
    pattern = token_pattern(ids, positions)
    assert pattern.dtype == torch.float32
    assert len(set(pattern.tolist())) == 3  # same token elsewhere, or another token: another value
    assert all(value == int(value) and 0 <= value < PATTERN_MODULUS for value in pattern.tolist())


def test_the_next_token_changes_with_any_value_read_and_never_is_a_special_id():
    sums = torch.tensor([1000.0, 1000.0, 1001.0])
    tokens = next_tokens(sums, torch.tensor([7, 7, 7]), torch.tensor([3, 3, 3]), vocab=4096)
    assert tokens[0] == tokens[1] != tokens[2]  # one block's value one off: another token
    assert next_tokens(sums[:1], torch.tensor([8]), torch.tensor([3]), 4096) != tokens[0]
    assert next_tokens(sums[:1], torch.tensor([7]), torch.tensor([4]), 4096) != tokens[0]
    many = next_tokens(torch.arange(5000, dtype=torch.float32) * 64, torch.zeros(5000), torch.zeros(5000), 4096)
    assert int(many.min()) >= FIRST_TOKEN and int(many.max()) < 4096
    assert len(set(many.tolist())) > 2500  # as spread as random draws (about 2,880 of 4,080), not a few tokens


def test_sums_of_patterns_are_exact_whatever_the_order():
    values = token_pattern(torch.arange(20000), torch.arange(20000)) + 63  # the last of 64 layers
    forward, backward = values.sum(), values.flip(0).sum()
    assert forward == backward == float(sum(int(v) for v in values.tolist()))
