"""The gateway: OpenAI's HTTP API in front of ``kvpush.generate``.

``async with Gateway(nats_url, model):`` serves ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (the process is up) and
``GET /ready`` (a scheduler routes to at least one prefill and one decode worker) until
closed; the routes are ``app``'s, each generation is ``serving``'s.

Starting loads the model's tokenizer (``prompts``), connects to NATS as the gateway and as
each tenant with a NATS user of its own, and listens (uvicorn, as vLLM's own server, with
no signal handlers of its own); closing stops listening, drains each connection, and stops
the tokenizer's thread.

API keys (``kvpush.services.gateway.keys``): with keys, a ``/v1`` request without a valid
``Authorization: Bearer <key>`` gets 401; each key is a tenant with its own kvpush client
(its own NATS connection and user, when the keys file gives it one) and its own limits
(``kvpush.services.gateway.limits``): a generation past them gets 429. ``/health``, ``/ready``
and ``/metrics`` need no key.

Bounded work before the bounds: the body is read as it arrives and refused (413) the
moment it would pass the NATS server's max_payload, whatever its transfer encoding; a
prompt is measured in bytes before anything tokenizes it; the chat template runs on a
thread of its own, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import AsyncIterator

import nats
import structlog
import uvicorn

from kvpush.client import generate
from kvpush.otel import endpoint
from kvpush.services.bus import close_connection
from kvpush.services.gateway import tool_calls
from kvpush.services.gateway.app import Guard, build_app
from kvpush.services.gateway.keys import KeyRing, Tenant
from kvpush.services.gateway.limits import Limiter
from kvpush.services.gateway.prompts import Prompts
from kvpush.services.lifecycle import Service
from kvpush.shared import settings, wire
from kvpush.shared.nats_security import ENV_VARS, connect_options, error_logger, server_urls

log = structlog.get_logger("kvpush.gateway")

DEFAULT_PORT = 8000
_LOGIN_VARIABLES = {ENV_VARS[d] for d in ("nats_user", "nats_password", "nats_token", "nats_nkey_seed", "nats_creds")}


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's owner decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Gateway(Service):
    """``keys``: who may call it, and as which kvpush client (default: anyone, as the
    gateway's own NATS identity, no limits). ``max_model_len``: the context the engines
    serve, which bounds a prompt's bytes before it is tokenized."""

    def __init__(self, nats_url: str, model: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 served_model_name: str | None = None, timeout_s: float = settings.DEADLINE_S + 30,
                 keys: KeyRing | None = None, max_model_len: int = settings.MAX_MODEL_LEN,
                 tool_call_parser: str = "auto"):
        self.nats_url = nats_url
        self.model = model
        self.host = host
        self.port = port
        self.served_model_name = served_model_name or model.rstrip("/").rsplit("/", 1)[-1]
        self.timeout_s = timeout_s
        self.keys = keys or KeyRing.open()
        self.max_model_len = max_model_len
        self.tool_call_parser_setting = tool_call_parser
        self.tool_call_parser: str | None = None  # set at start: the model's format, or None (tools refused)
        self.nc = None  # the gateway's own NATS identity: /ready, and tenants without a NATS user
        self._tenant_connections: dict[str, nats.NATS] = {}  # tenant name -> its own NATS identity
        self._limiters = {tenant.name: Limiter(tenant.limits, time.monotonic()) for tenant in self.keys.tenants}
        self.prompts = Prompts(model, self.served_model_name, max_model_len)  # the tokenizer, on its own thread
        self._server: _Server | None = None
        self._serving: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> None:
        await self.prompts.load()
        self.tool_call_parser = tool_calls.parser_of(self.tool_call_parser_setting,
                                                     getattr(self.prompts.tokenizer, "chat_template", None))
        self.nc = await nats.connect(server_urls(self.nats_url), name="kvpush-gateway", max_reconnect_attempts=-1,
                                     error_cb=error_logger("kvpush-gateway"), **connect_options())
        for tenant in self.keys.tenants:
            if tenant.nats_user is not None:  # like the gateway's own: waits for NATS, and says why it cannot log in
                self._tenant_connections[tenant.name] = await nats.connect(
                    server_urls(self.nats_url), name=f"kvpush-gateway-{tenant.name}", max_reconnect_attempts=-1,
                    error_cb=_tenant_errors(tenant), **connect_options(tenant_login(tenant)))
        config = uvicorn.Config(Guard(build_app(self), self), host=self.host, port=self.port, log_level="warning",
                                lifespan="off", access_log=False)
        self._server = _Server(config)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # the bind failed: raise it
                raise RuntimeError(f"the gateway could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        if self.port == 0:
            self.port = self._server.servers[0].sockets[0].getsockname()[1]
        # A metrics port of its own (KVPUSH_METRICS_PORT) says it serves HTTP; whether kvpush
        # routes to workers is the gateway's own /ready.
        endpoint.mark_ready()
        log.info("gateway ready", url=self.url, model=self.served_model_name,
                 keys="required" if self.keys.required else "none", tenants=len(self.keys.tenants))

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            await asyncio.gather(self._serving, return_exceptions=True)
        for nc in [*self._tenant_connections.values(), self.nc]:
            if nc is not None:
                await close_connection(nc)
        self.prompts.close()

    # ------------------------------------------------------------------ requests

    def connection(self, tenant: Tenant):
        """The NATS connection that serves ``tenant``: its own, or the gateway's."""
        return self._tenant_connections.get(tenant.name, self.nc)

    def limiter(self, tenant: Tenant) -> Limiter:
        return self._limiters[tenant.name]

    def replies(self, tenant: Tenant, body: dict, headers: dict[str, str]) -> AsyncIterator[wire.Reply]:
        return generate(self.connection(tenant), body, timeout=self.timeout_s, headers=headers)


def _tenant_errors(tenant: Tenant):
    async def said(exc: Exception) -> None:
        log.warning("a tenant's NATS connection failed", tenant=tenant.name, nats_user=tenant.nats_user,
                    error=str(exc))
    return said


def tenant_login(tenant: Tenant, env=os.environ) -> dict[str, str]:
    """The environment ``connect_options`` reads for ``tenant``'s own connection: the
    gateway's (TLS and all) with the tenant's NATS user and password for its login."""
    return {**{k: v for k, v in env.items() if k not in _LOGIN_VARIABLES},
            ENV_VARS["nats_user"]: tenant.nats_user, ENV_VARS["nats_password"]: tenant.nats_password}
