"""Who may publish and subscribe on which subject: the rules the NATS server enforces, one
user per worker, scheduler and client. Everything a receiver trusts about a sender rests
on them (``wire.forged_sender``): a worker may publish only under its own name, read only
its own jobs, and answer only its own agent requests; a client may read only its own inbox
and send or cancel only its own requests.

Why static per-identity users, and not JWTs or an auth callout. Permission templates
(``{{name()}}``) would let one rule serve every worker, but nats-server honours them only
for JWT users or users an auth callout issues; JWTs need the ``nkeys`` and ``nats-jwt``
packages and an operator toolchain (no ``nsc`` here), and a callout is one more service on
the login path of every process. Static users need nothing but the server: each is
spelled out in the file, the server checks every publish and subscribe, and adding a worker is
a config reload (``nats-server --signal reload``, or SIGHUP), which keeps every
connection. ``render_config`` writes the file; ``kvpush nats-config`` calls it.

Pure: imports no NATS.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

from kvpush.shared import wire

IdentityRole = wire.IdentityRole


@dataclass(frozen=True)
class Permissions:
    publish: list[str]
    subscribe: list[str]
    allow_responses: bool = False


@dataclass(frozen=True)
class Identity:
    role: IdentityRole
    name: str
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        problem = wire.identity_problem(self.name)
        if problem is not None:
            raise ValueError(problem)
        if self.role not in ("scheduler", "prefill", "decode", "client"):
            raise ValueError(f"role must be scheduler, prefill, decode or client, not {self.role!r}")


def service_inbox(name: str) -> str:
    """The inbox prefix of a service (``nats.connect(inbox_prefix=...)``): replies to it
    land where no client may subscribe."""
    return f"{wire.SERVICE_INBOX_PREFIX}.{name}"


def client_inbox(name: str) -> str:
    """The inbox prefix of a named client: only it may subscribe there."""
    return f"{wire.CLIENT_INBOX_PREFIX}.{name}"


def permissions(role: IdentityRole, name: str) -> Permissions:
    """What the NATS user ``name`` of ``role`` may do: each use the subject table gives its
    role (``wire.SUBJECTS``, ``wire.DURABLE``), made concrete for ``name``.

    What they come to: a worker publishes only under its own name, subscribes only to its
    own jobs and KV subjects, and answers only services' inboxes, never with
    ``allow_responses``: with it, a worker could publish once on whatever reply subject a
    message it receives names, and it receives its own agent announcements, so it could name
    ``$JS.API...PURGE`` or any ``$KV.`` subject and answer itself there (a deny list does not
    stop a response). Schedulers are trusted with JetStream (the buckets, the claims streams,
    the API); nobody else may touch a ``$KV.`` subject or the JetStream API, but for a
    decode's direct get of its own claims. Claims are published under the claimant's own name
    only, and a decode's only in its own stream (``wire.claims_stream``), so that claims it
    floods fill only that. A client sends, cancels, fetches and asks status only under its
    own name, and reads only its own inboxes."""
    publish: list[str] = []
    subscribe: list[str] = []
    answers = False
    for route in (*wire.SUBJECTS, *wire.DURABLE):
        publish += [_granted(route.subject, use, name) for use in route.publishers
                    if use.role == role and use.grant is not wire.Grant.OPEN]
        subscribe += [_granted(route.subject, use, name) for use in route.subscribers
                      if use.role == role and use.grant is not wire.Grant.OPEN]
        answers = answers or any(use.role == role and use.answers for use in route.subscribers)
    return Permissions(publish=publish, subscribe=subscribe, allow_responses=answers)


def _granted(subject: str, use: wire.Use, name: str) -> str:
    """The NATS permission that ``use`` of ``subject`` gives the user ``name``."""
    if use.grant is wire.Grant.OWN:
        if isinstance(subject, wire.SubjectTree):
            return subject.under(name)
        return subject.partly(**dict.fromkeys(use.parts, name))
    every = subject.wildcard if isinstance(subject, (wire.SubjectTemplate, wire.SubjectTree)) else subject
    return f"{every} {wire.SCHEDULER_QUEUE_GROUP}" if use.grant is wire.Grant.QUEUE else every


def env_password(identity: Identity) -> str:
    """A password the server reads from its environment: ``$NATS_PASSWORD_PREFILL_0``."""
    return "$" + password_variable(identity.name)


def password_variable(name: str) -> str:
    return "NATS_PASSWORD_" + name.upper().replace("-", "_")


def literal_password(identity: Identity) -> str:
    return _quoted(identity.password)


def new_password() -> str:
    """A random password that nats-server reads as a string wherever it stands: a value
    given through ``$VARIABLE`` is parsed as a config token, so one that starts with ``-``
    or a digit can read as a broken number or date and stop the server (about 1 in 50 of
    ``token_urlsafe``'s). This one starts with a letter."""
    return "k" + secrets.token_urlsafe(18)


ACCOUNT = "KVPUSH"
"""The account every kvpush user is in (``$G``, the default account, is reserved)."""

_SIZE = re.compile(r"(0|[1-9][0-9]*)([KMGT]i?B?)?", re.IGNORECASE)


@dataclass(frozen=True)
class JetStreamLimits:
    """The JetStream limits of kvpush's account. The server refuses a stream or consumer
    that would pass one, so a scheduler, which may use the JetStream API, cannot fill the
    server's disk or memory with streams of its own. What kvpush makes (services/ledger.py),
    all on file: the ``kvpush_flights`` bucket (no byte limit: a record is small and expires
    with its request's deadline), the ``kvpush_finals`` bucket (``wire.FINALS_MAX_BYTES``,
    256 MiB), and the claims streams: one per decode and one for attempts with no decode
    yet (``wire.claims_stream``; ``wire.CLAIMS_MAX_BYTES`` each, small messages).

    - ``max_memory``: bytes of memory-backed streams. kvpush keeps none: 0 refuses them.
    - ``max_file``: bytes of file-backed streams, counted once per replica. nats-server
      reserves each stream's ``max_bytes`` (times its replicas) when it is made and refuses
      a stream that would not fit, so finals and claims hold their sum of it at one
      replica, three times that at three (``--jetstream-replicas 3``, deploy/k8s); the
      rest is for the flights, which have no byte limit of their own.
    - ``max_streams``: streams in the account. kvpush makes three, and one per decode;
      ``for_identities`` leaves room for four more (a bucket made anew beside the old one
      by an upgrade).
    - ``max_consumers``: consumers on any one stream (nats-server applies the account's
      limit per stream). Each scheduler watches the flights with one, made anew after a
      reconnect while the old one lingers until the server drops it; 64 leaves room for
      dozens of schedulers.

    Sizes are nats-server's: ``512MiB``, ``2GiB``, ``1G`` (10^9), or bytes."""

    max_memory: str = "0"
    max_file: str = "2GiB"
    max_streams: int = 8
    max_consumers: int = 64

    @classmethod
    def for_identities(cls, identities: list["Identity"]) -> "JetStreamLimits":
        """Room for what kvpush makes with these identities: a claims stream per decode,
        every stream's bytes reserved at three replicas, and 1 GiB for the flights."""
        decodes = sum(1 for identity in identities if identity.role == "decode")
        reserved = wire.FINALS_MAX_BYTES + (decodes + 1) * wire.CLAIMS_MAX_BYTES
        return cls(max_file=f"{(3 * reserved + 2**30) // 2**20}MiB", max_streams=3 + decodes + 4)

    def __post_init__(self) -> None:
        for name in ("max_memory", "max_file"):
            if not _SIZE.fullmatch(str(getattr(self, name))):
                raise ValueError(f"{name} must be a size such as 512MiB, 2GiB or a number of bytes, "
                                 f"not {getattr(self, name)!r}")
        for name in ("max_streams", "max_consumers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, not {getattr(self, name)!r}")


def render_config(identities: list[Identity], password: Callable[[Identity], str] = env_password,
                  tls: dict[str, str] | None = None, port: int = 4222, max_payload: str = "8MB",
                  extra: str = "", listen: str | None = "127.0.0.1",
                  limits: JetStreamLimits | None = None) -> str:
    """A nats-server config with one user per identity and its permissions, all in the
    account ``ACCOUNT`` with JetStream ``limits``. ``password`` writes each user's password
    (by default a ``$VARIABLE`` the server reads from its environment); ``tls``:
    ``cert_file``, ``key_file``, ``ca_file`` for mutual TLS; ``listen``: the address the
    server binds (None: every address); ``limits``: by default what these identities need
    (``JetStreamLimits.for_identities``)."""
    limits = limits or JetStreamLimits.for_identities(identities)
    names = [identity.name for identity in identities]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ValueError(f"each identity needs its own name; repeated: {', '.join(duplicated)}")
    decodes = sum(1 for identity in identities if identity.role == "decode")
    reserved = (wire.FINALS_MAX_BYTES + (decodes + 1) * wire.CLAIMS_MAX_BYTES) // 2**20
    lines = [
        "# Generated by `kvpush nats-config` (shared/permissions.py): one user per identity, in",
        f"# the account {ACCOUNT}, whose JetStream limits bound what its streams may hold.",
    ]
    if listen is not None:
        lines.append(f"host: {_quoted(listen)}")
    lines += [f"port: {port}", f"max_payload: {max_payload}"]
    if tls:
        lines += ["tls {", *(f"  {key}: {_quoted(value)}" for key, value in tls.items()),
                  "  verify: true", "  timeout: 2", "}"]
    lines += [
        "accounts {",
        f"  {ACCOUNT} {{",
        "    jetstream {",
        "      # bytes in memory-backed streams: kvpush keeps none (0: none may be made)",
        f"      max_memory: {limits.max_memory}",
        "      # bytes in file-backed streams, once per replica; a stream's max_bytes is reserved",
        f"      # when it is made (finals and claims: {reserved} MiB at one replica, {3 * reserved} at three)",
        "      # and 1 GiB for the flights",
        f"      max_file: {limits.max_file}",
        "      # streams: kvpush makes three (kvpush_flights, kvpush_finals, kvpush_claims) and",
        "      # one per decode (kvpush_claims_<decode>), and an upgrade may make a few anew",
        f"      max_streams: {limits.max_streams}",
        "      # consumers on any one stream: each scheduler watches the flights with one",
        f"      max_consumers: {limits.max_consumers}",
        "    }",
        "    users = [",
    ]
    for identity in identities:
        rules = permissions(identity.role, identity.name)
        lines += [
            "      {",
            f"        # {identity.role}",
            f"        user: {_quoted(identity.name)}",
            f"        password: {password(identity)}",
            "        permissions {",
            f"          publish {{ allow: [{', '.join(_quoted(s) for s in rules.publish)}] }}",
            f"          subscribe {{ allow: [{', '.join(_quoted(s) for s in rules.subscribe)}] }}",
        ]
        if rules.allow_responses:
            lines.append("          allow_responses: true")
        lines += ["        }", "      }"]
    lines += ["    ]", "  }", "}"]
    if extra:
        lines.append(extra)
    return "\n".join(lines) + "\n"


SAMPLE_IDENTITIES = [
    Identity("scheduler", "scheduler-0"), Identity("scheduler", "scheduler-1"),
    Identity("prefill", "prefill-0"), Identity("prefill", "prefill-1"),
    Identity("decode", "decode-0"), Identity("decode", "decode-1"),
    Identity("client", "client-0"),
]
SAMPLE_HEADER = """\
# deploy/nats-server.conf: a sample nats-server configuration for kvpush. Mutual TLS, the
# loopback address only, and one NATS user per worker, scheduler and client, each allowed
# only its own subjects (shared/permissions.py says why static users, and what each rule
# protects), in one account whose JetStream limits cap the streams' disk, memory, number
# and consumers.
#
# Regenerate it, or write one for your own workers, with `kvpush nats-config`
# (`kvpush nats-config --sample > deploy/nats-server.conf` gives exactly this file).
# Adding a worker: add its user and reload (`nats-server --signal reload`); nobody is
# disconnected. Start each worker as its user: its id is its NATS user.
#
#   python -m kvpush.tools.dev_certs                      # dev certificates into deploy/certs/
#   export NATS_PASSWORD_SCHEDULER_0=... NATS_PASSWORD_PREFILL_0=... (one per user below)
#   cd deploy && nats-server -c nats-server.conf -js
#
# Paths: nats-server opens the certificate files relative to its WORKING DIRECTORY,
# hence the `cd deploy`. Passwords: `$NAME` is read from the server's environment, and the
# server refuses to start while one is missing, so no sample password can be left in
# place. A bcrypt hash (`nats-server --pass`) works too.
#
# host: 127.0.0.1, so only this machine can connect; `kvpush nats-config --listen 0.0.0.0`
# (or the address of one interface) for workers on other hosts.
#
# max_payload: a KV registration or agent announcement carries a NIXL agent blob and the
# block layout; 8 MB leaves room for large models. kvpush refuses (PayloadTooLarge) what
# the server would not accept.
#
# accounts: the users are in the account KVPUSH (the default account, $G, cannot take
# limits), whose jetstream block bounds what a scheduler, which may use the JetStream API,
# can make (`kvpush nats-config --js-max-file ...`; JetStreamLimits says what each bounds).
"""
SAMPLE_TLS = {"cert_file": "certs/server.pem", "key_file": "certs/server-key.pem", "ca_file": "certs/ca.pem"}


def sample_config() -> str:
    """deploy/nats-server.conf, exactly."""
    return SAMPLE_HEADER + render_config(SAMPLE_IDENTITIES, env_password, tls=SAMPLE_TLS)


def _quoted(value: str) -> str:
    if '"' in value or "\\" in value or "\n" in value:
        raise ValueError("a NATS config value may not contain quotes, backslashes or newlines")
    return f'"{value}"'
