"""API keys: who an HTTP request is (``Authorization: Bearer <key>``, as vLLM's and
OpenAI's clients send it), as which kvpush client it is served, and its limits.

Three ways to run the gateway:

- no keys: everyone is one tenant, the gateway's own NATS identity (as before keys);
- ``--api-key KEY``: the same, behind one key (``vllm serve --api-key``);
- ``--api-keys-file FILE``: one tenant per key, each its own kvpush client.

The keys file is TOML, one table per tenant (its name: a NATS identity's letters)::

    [tenants.team-a]
    key = "sk-team-a-0f3c..."
    nats_user = "team-a"                     # its own NATS user (kvpush nats-config --clients team-a)
    nats_password_file = "team-a.password"   # or nats_password = "..."; relative to this file
    max_concurrent = 4                       # optional, else --max-concurrent-per-key
    rate_per_s = 2.0                         # optional, else --rate-per-key
    burst = 4                                # optional, else --burst-per-key

A tenant with a NATS user of its own sends on ``kvpush.generate.<user>`` and reads
``_INBOX.<user>``: NATS and the schedulers (which key requests by client and id) keep its
request ids apart from every other tenant's. A tenant without one shares the gateway's
NATS identity; the gateway then puts ``<tenant>/`` before its request ids, so that one key
still cannot address another's requests. Pure: no NATS, no HTTP.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvpush.services.gateway.errors import Unauthorized
from kvpush.services.gateway.limits import Limits
from kvpush.shared import wire

TENANT_FIELDS = {"key", "nats_user", "nats_password", "nats_password_file", "max_concurrent", "rate_per_s", "burst"}


@dataclass(frozen=True)
class Tenant:
    """One API key's holder. ``name`` is "" for the single tenant of a gateway without a
    keys file. ``nats_user`` None: the gateway's own NATS identity serves it."""

    name: str
    limits: Limits = Limits()
    nats_user: str | None = None
    nats_password: str | None = field(default=None, repr=False)
    id_prefix: str = ""  # put before its request ids on NATS: tenants that share one identity

    def kvpush_id(self, request_id: str) -> str:
        """The request id on NATS of the id the HTTP client gave."""
        return self.id_prefix + request_id


class KeyRing:
    """The tenants, found by their keys' SHA-256 (the keys themselves are not kept)."""

    def __init__(self, tenants: dict[str, Tenant] | None = None, anonymous: Tenant | None = None):
        self._by_digest = {_digest(key): tenant for key, tenant in (tenants or {}).items()}
        self._anonymous = anonymous

    @classmethod
    def open(cls, limits: Limits = Limits()) -> "KeyRing":
        """No keys: every request is the one tenant."""
        return cls(anonymous=Tenant("", limits))

    @classmethod
    def single(cls, key: str, limits: Limits = Limits()) -> "KeyRing":
        """``--api-key``: one key, one tenant, the gateway's NATS identity."""
        if not key:
            raise ValueError("the API key is empty")
        return cls({key: Tenant("", limits)})

    @classmethod
    def from_file(cls, path: str | Path, defaults: Limits = Limits(), gateway_user: str | None = None) -> "KeyRing":
        """``--api-keys-file``. ``gateway_user``: the gateway's own NATS user, if any (a
        tenant given that user shares the gateway's identity)."""
        path = Path(path)
        try:
            document = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"the keys file {path} cannot be read: {exc}") from None
        unknown = set(document) - {"tenants"}
        if unknown:
            raise ValueError(f"the keys file {path}: unknown top-level entries {sorted(unknown)}; "
                             "write one [tenants.<name>] table per key")
        tables = document.get("tenants") or {}
        if not tables:
            raise ValueError(f"the keys file {path} holds no [tenants.<name>] table")
        tenants: dict[str, Tenant] = {}
        users: dict[str, str] = {}
        for name, table in tables.items():
            key, tenant = _tenant(path, name, table, defaults, gateway_user)
            if key in tenants:
                raise ValueError(f"the keys file {path}: tenants {tenants[key].name!r} and {name!r} have the same key")
            if tenant.nats_user is not None:
                if tenant.nats_user in users:
                    raise ValueError(f"the keys file {path}: tenants {users[tenant.nats_user]!r} and {name!r} have "
                                     f"the same NATS user {tenant.nats_user!r}; each needs its own")
                users[tenant.nats_user] = name
            tenants[key] = tenant
        return cls(tenants)

    @property
    def required(self) -> bool:
        return self._anonymous is None

    @property
    def tenants(self) -> list[Tenant]:
        return [self._anonymous] if self._anonymous is not None else list(self._by_digest.values())

    def tenant(self, authorization: str | None) -> Tenant:
        """Who sent a request with this ``Authorization`` header; raises Unauthorized."""
        if self._anonymous is not None:
            return self._anonymous
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("an API key is required: send the header 'Authorization: Bearer <key>'")
        tenant = self._by_digest.get(_digest(key.strip()))
        if tenant is None:
            raise Unauthorized("the API key is not valid")
        return tenant


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _tenant(path: Path, name: str, table, defaults: Limits, gateway_user: str | None) -> tuple[str, Tenant]:
    where = f"the keys file {path}, tenant {name!r}"
    if (problem := wire.identity_problem(name)) is not None:
        raise ValueError(f"{where}: {problem}")
    if not isinstance(table, dict):
        raise ValueError(f"{where}: write it as a table, [tenants.{name}]")
    unknown = set(table) - TENANT_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}; known: {sorted(TENANT_FIELDS)}")
    key = table.get("key")
    if not isinstance(key, str) or not key.strip() or key != key.strip() or " " in key:
        raise ValueError(f"{where}: 'key' must be a non-empty string without spaces")
    user = table.get("nats_user")
    password = table.get("nats_password")
    if "nats_password_file" in table:
        if password is not None:
            raise ValueError(f"{where}: give nats_password or nats_password_file, not both")
        file = path.parent / table["nats_password_file"]
        try:
            password = file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"{where}: nats_password_file: {exc}") from None
    if user is not None:
        if not isinstance(user, str) or (problem := wire.identity_problem(user)) is not None:
            raise ValueError(f"{where}: nats_user: {problem or 'must be a string'}")
        if not isinstance(password, str) or not password:
            raise ValueError(f"{where}: nats_user {user!r} needs nats_password or nats_password_file")
    elif password is not None:
        raise ValueError(f"{where}: a NATS password without nats_user")
    try:
        limits = replace(defaults, **{k: table[k] for k in ("max_concurrent", "rate_per_s", "burst") if k in table})
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    shared = user is None or user == gateway_user
    return key, Tenant(name, limits, None if shared else user, None if shared else password,
                       id_prefix=f"{name}/" if shared else "")
