"""The gateway's API keys and per-key limits (``kvpush.services.gateway.keys``, ``.limits``):
who a header is, what a keys file may say, and the token bucket's arithmetic."""

from __future__ import annotations

import pytest

from kvpush.services.gateway.errors import RateLimited, TooManyConcurrent, Unauthorized
from kvpush.services.gateway.keys import KeyRing, Tenant
from kvpush.services.gateway.limits import Limiter, Limits, TokenBucket

KEYS = """
[tenants.team-a]
key = "sk-a"
nats_user = "team-a"
nats_password_file = "team-a.password"
max_concurrent = 2

[tenants.team-b]
key = "sk-b"
rate_per_s = 0.5
"""


def keys_file(tmp_path, text: str = KEYS):
    (tmp_path / "team-a.password").write_text("pw-a\n")
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


def test_a_keys_file_gives_each_key_its_tenant_identity_and_limits(tmp_path):
    ring = KeyRing.from_file(keys_file(tmp_path), Limits(max_concurrent=8, rate_per_s=10))
    a, b = ring.tenant("Bearer sk-a"), ring.tenant("bearer sk-b")
    assert (a.name, a.nats_user, a.nats_password, a.id_prefix) == ("team-a", "team-a", "pw-a", "")
    assert a.limits == Limits(max_concurrent=2, rate_per_s=10)  # its own, else the defaults
    assert (b.name, b.nats_user, b.id_prefix) == ("team-b", None, "team-b/")  # shares the gateway's identity
    assert b.limits == Limits(max_concurrent=8, rate_per_s=0.5)
    assert b.kvpush_id("r-1") == "team-b/r-1" and a.kvpush_id("r-1") == "r-1"
    assert ring.required and len(ring.tenants) == 2


@pytest.mark.parametrize("header", [None, "", "sk-a", "Basic sk-a", "Bearer ", "Bearer sk-c", "Bearer sk-a2"])
def test_without_a_known_bearer_key_a_request_is_unauthorized(tmp_path, header):
    ring = KeyRing.from_file(keys_file(tmp_path))
    with pytest.raises(Unauthorized):
        ring.tenant(header)


def test_no_keys_is_everyone_as_one_tenant_and_one_key_is_that_tenant_behind_a_key():
    assert not KeyRing.open().required and KeyRing.open().tenant(None) == Tenant("")
    single = KeyRing.single("sk-1")
    assert single.tenant("Bearer sk-1") == Tenant("")
    with pytest.raises(Unauthorized):
        single.tenant(None)


def test_a_tenant_logged_in_as_the_gateways_own_user_shares_its_identity(tmp_path):
    text = KEYS.replace('nats_user = "team-a"', 'nats_user = "gateway"')
    a = KeyRing.from_file(keys_file(tmp_path, text), gateway_user="gateway").tenant("Bearer sk-a")
    assert (a.nats_user, a.id_prefix) == (None, "team-a/")


@pytest.mark.parametrize("text, says", [
    (KEYS.replace('key = "sk-b"', 'key = "sk-a"'), "the same key"),
    (KEYS.replace("rate_per_s", "rate"), "unknown fields ['rate']"),
    (KEYS.replace('nats_password_file = "team-a.password"', ""), "needs nats_password"),
    (KEYS.replace('nats_password_file = "team-a.password"', 'nats_password_file = "missing"'), "nats_password_file"),
    (KEYS + '[tenants.team-c]\nkey = "sk-c"\nnats_user = "team-a"\nnats_password = "x"\n', "the same NATS user"),
    (KEYS.replace("[tenants.team-b]", "[tenants.\"team b\"]"), "not a valid id"),
    (KEYS.replace("max_concurrent = 2", "max_concurrent = -1"), "max_concurrent must be a number >= 0"),
    (KEYS.replace('key = "sk-b"', 'key = ""'), "'key' must be"),
    ("[tenants]\n", "holds no [tenants.<name>] table"),
    ('key = "sk"\n', "unknown top-level entries"),
    ("[tenants.a\n", "cannot be read"),
], ids=["same-key", "unknown-field", "no-password", "password-file-missing", "same-user", "bad-name",
        "negative-limit", "empty-key", "empty", "top-level", "not-toml"])
def test_a_keys_file_that_cannot_be_served_is_refused_with_a_sentence(tmp_path, text, says):
    path = keys_file(tmp_path, text)
    with pytest.raises(ValueError) as refused:
        KeyRing.from_file(path)
    assert says in str(refused.value)


def test_the_bucket_holds_burst_tokens_and_refills_at_its_rate():
    bucket = TokenBucket(rate_per_s=0.5, size=2, now=100.0)
    assert bucket.take(100.0) == 0.0 and bucket.take(100.0) == 0.0
    assert bucket.take(100.0) == pytest.approx(2.0)  # one token takes 2 s at 0.5/s
    assert bucket.take(101.0) == pytest.approx(1.0)
    assert bucket.take(102.0) == 0.0
    assert bucket.take(1000.0) == 0.0 and bucket.take(1000.0) == 0.0  # full again, never over its size
    assert bucket.take(1000.0) > 0


def test_a_request_refused_for_concurrency_takes_no_token_and_a_release_makes_room():
    limiter = Limiter(Limits(max_concurrent=1, rate_per_s=1, burst=2), now=0.0)
    limiter.admit(0.0)
    with pytest.raises(TooManyConcurrent):
        limiter.admit(0.0)
    limiter.release()
    limiter.admit(0.0)  # the second token: the refusal took none
    limiter.release()
    with pytest.raises(RateLimited) as limited:
        limiter.admit(0.0)
    assert limited.value.retry_after_s == pytest.approx(1.0) and limited.value.code == "rate_limit_exceeded"
    assert limiter.in_progress == 0


def test_no_limits_admit_everything():
    limiter = Limiter(Limits())
    for _ in range(1000):
        limiter.admit(0.0)
    assert limiter.in_progress == 1000
