"""The nats-server a tests/nats test runs on: plain (no users), or as users deploy it, under
the configuration ``kvpush nats-config`` generates (one user per identity, each allowed only
its own subjects, and mutual TLS). A test that touches JetStream, claims, finals,
identities or takeover runs on both (``NATS_KINDS``); what the server refuses an identity
then fails the test as it would fail a deployment.

Every service or client of a test logs in as a fresh identity of its role
(``identity(role)``): on the deployed server one of a pool of users generated up front,
on the plain one a new name. ``url_for(name)`` carries that identity's password, so the
code under test connects as it does in production (``kvpush.shared.nats_security``: TLS from the
``KVPUSH_NATS_TLS_*`` variables, which this sets while the server runs)."""

from __future__ import annotations

import itertools
import os
import tempfile
import uuid
from pathlib import Path

import nats

from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.shared import permissions
from kvpush.shared.nats_security import connect_options
from kvpush.tools import dev_certs

NATS_KINDS = ["plain", "deployed"]
POOL = {"scheduler": 96, "prefill": 96, "decode": 128, "client": 96}  # identities per role, per server
OBSERVER = "scheduler-observer"  # the tests' own eyes (kvpush.invalid, the buckets): a scheduler's rights
TLS_ENV = {"KVPUSH_NATS_TLS_CA": "ca.pem", "KVPUSH_NATS_TLS_CERT": "client.pem", "KVPUSH_NATS_TLS_KEY": "client-key.pem"}


class NatsUnderTest:
    """``with NatsUnderTest("deployed") as server:`` a running nats-server; ``server.url``
    has no credentials (a connection there is refused on the deployed server)."""

    def __init__(self, kind: str = "plain"):
        if kind not in NATS_KINDS:
            raise ValueError(f"kind must be one of {NATS_KINDS}, not {kind!r}")
        self.kind = kind
        self.deployed = kind == "deployed"
        self._folder: tempfile.TemporaryDirectory | None = None
        self._server: LocalNatsServer | None = None
        self._passwords: dict[str, str] = {}
        self._roles: dict[str, str] = {}
        self._free: dict[str, itertools.count] = {role: itertools.count() for role in POOL}
        self._saved_env: dict[str, str | None] = {}

    # ------------------------------------------------------------------ identities

    def identity(self, role: str) -> str:
        """A name of ``role`` no one on this server has used yet."""
        if not self.deployed:
            name = f"{role}-{uuid.uuid4().hex[:8]}"
            self._roles[name] = role
            return name
        index = next(self._free[role])
        if index >= POOL[role]:
            raise RuntimeError(f"the deployed test server has only {POOL[role]} {role} identities: raise POOL")
        return f"{role}-{index}"

    def observer(self) -> str:
        """The identity a test itself reads and cleans JetStream with, and hears refusals as."""
        if not self.deployed:
            self._roles[OBSERVER] = "scheduler"
        return OBSERVER

    def role_of(self, name: str) -> str:
        return self._roles.get(name) or name.rsplit("-", 1)[0]

    def url_for(self, name: str) -> str:
        """The server's URL, logged in as ``name`` (no credentials on the plain server)."""
        if not self.deployed:
            return self.url
        return f"nats://{name}:{self._passwords[name]}@127.0.0.1:{self._server.port}"

    async def connect(self, name: str, **kwargs) -> nats.NATS:
        """A connection as ``name``, with the inbox prefix its role gets in production
        (``_INBOX.<client>`` for a client, ``_KVPUSH_INBOX.<service>`` for a service)."""
        service = None if self.role_of(name) == "client" else name
        env = dict(os.environ)
        if self.deployed:
            env |= {"KVPUSH_NATS_USER": name, "KVPUSH_NATS_PASSWORD": self._passwords[name]}
            options = connect_options(env, service=service)
        else:
            options = {"inbox_prefix": (permissions.client_inbox(name) if service is None
                                        else permissions.service_inbox(name))}
        return await nats.connect(self.url, name=name, **options, **kwargs)

    async def connect_anonymous(self, **kwargs) -> nats.NATS:
        """A connection with no name: only the plain server takes it."""
        return await nats.connect(self.url, **kwargs)

    # ------------------------------------------------------------------ the server

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def server(self) -> LocalNatsServer:
        return self._server

    def __enter__(self) -> "NatsUnderTest":
        if not self.deployed:
            self._server = LocalNatsServer().start()
            return self
        self._folder = tempfile.TemporaryDirectory(prefix="kvpush-deployed-nats-")
        folder = Path(self._folder.name)
        certs = dev_certs.generate(folder / "certs")
        identities = [permissions.Identity("scheduler", OBSERVER, permissions.new_password())]
        self._passwords[OBSERVER] = identities[0].password
        for role, count in POOL.items():
            for index in range(count):
                identity = permissions.Identity(role, f"{role}-{index}", permissions.new_password())
                identities.append(identity)
                self._passwords[identity.name] = identity.password
        config = folder / "nats-server.conf"
        config.write_text(permissions.render_config(
            identities, permissions.literal_password,
            tls={"cert_file": str(certs / "server.pem"), "key_file": str(certs / "server-key.pem"),
                 "ca_file": str(certs / "ca.pem")}))
        for variable, file in TLS_ENV.items():
            self._saved_env[variable] = os.environ.get(variable)
            os.environ[variable] = str(certs / file)
        self._server = LocalNatsServer(config=config).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.stop()
        for variable, value in self._saved_env.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        if self._folder is not None:
            self._folder.cleanup()
