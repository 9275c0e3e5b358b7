"""The gateway's own refusals: HTTP-only conditions that never travel on NATS, so they
live here rather than in ``kvpush.shared.errors`` (whose codes are the wire's).

    KvpushError
    ├── Unauthorized            401 no API key, or one the gateway does not know
    └── RateLimited             429 the key started more requests than its rate allows
        └── TooManyConcurrent   429 the key has as many requests in progress as it may

Each carries its HTTP status; ``kvpush.services.gateway.responses.error`` turns it into an
OpenAI error object (codes as OpenAI's: ``invalid_api_key``, ``rate_limit_exceeded``).
"""

from __future__ import annotations

from kvpush.shared.errors import KvpushError


class Unauthorized(KvpushError):
    code = "invalid_api_key"
    http_status = 401


class RateLimited(KvpushError):
    code = "rate_limit_exceeded"
    http_status = 429

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManyConcurrent(RateLimited):
    code = "concurrency_limit_exceeded"
