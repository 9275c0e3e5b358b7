"""NATS authentication and TLS settings for every kvpush process, read from the environment.

Why environment variables: the KV connector does not run in the process that parsed the
command line. vLLM starts its engine core in a child process, builds the connector there,
and hands it only what is in vLLM's own config (``kv_connector_extra_config``, which
carries the NATS URL). Secrets do not belong in that config (it is logged and pickled),
and its schema is vLLM's. The environment, by contrast, is inherited by every child
process. So the CLI turns its ``--nats-*`` flags into ``KVPUSH_NATS_*`` variables
(``export_arguments``) and every place that opens a NATS connection, in whichever
process, calls ``nats.connect(server_urls(url), **connect_options())``.

    KVPUSH_NATS_USER, KVPUSH_NATS_PASSWORD   user and password
    KVPUSH_NATS_TOKEN                        a token
    KVPUSH_NATS_NKEY_SEED                    path to an nkey seed file
    KVPUSH_NATS_CREDS                        path to a .creds file (JWT + nkey seed)
    KVPUSH_NATS_TLS_CA                       path to the CA that signed the server certificate
    KVPUSH_NATS_TLS_CERT, KVPUSH_NATS_TLS_KEY  client certificate and key (mutual TLS)

At most one of the four ways to authenticate may be given. An empty variable counts as
unset. This module does not import nats, so it can be used (and tested) anywhere.

Inboxes. A service (``service=`` its id) takes replies under ``_KVPUSH_INBOX.<id>``, a
client logged in as a user under ``_INBOX.<user>``: with per-identity users
(``kvpush.shared.permissions``) those are the only inboxes each may read.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from collections.abc import Mapping, MutableMapping

from kvpush.shared import permissions
from kvpush.shared.errors import KvpushError

ENV_VARS: dict[str, str] = {
    "nats_user": "KVPUSH_NATS_USER",
    "nats_password": "KVPUSH_NATS_PASSWORD",
    "nats_token": "KVPUSH_NATS_TOKEN",
    "nats_nkey_seed": "KVPUSH_NATS_NKEY_SEED",
    "nats_creds": "KVPUSH_NATS_CREDS",
    "nats_tls_ca": "KVPUSH_NATS_TLS_CA",
    "nats_tls_cert": "KVPUSH_NATS_TLS_CERT",
    "nats_tls_key": "KVPUSH_NATS_TLS_KEY",
}
"""argparse destination of each ``--nats-*`` flag -> the environment variable it sets."""

_PATHS = ("nats_nkey_seed", "nats_creds", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")

_HELP = {
    "nats_user": "NATS user name",
    "nats_password": "NATS password (visible in the process list: prefer the variable)",
    "nats_token": "NATS authentication token (visible in the process list: prefer the variable)",
    "nats_nkey_seed": "path to an nkey seed file",
    "nats_creds": "path to a NATS .creds file (user JWT and nkey seed)",
    "nats_tls_ca": "path to the CA certificate that signed the NATS server's certificate",
    "nats_tls_cert": "path to this client's TLS certificate (mutual TLS; needs --nats-tls-key)",
    "nats_tls_key": "path to the key of --nats-tls-cert",
}


class NatsConfigError(KvpushError, ValueError):
    """The NATS security settings contradict each other or name a missing file."""

    code = "nats_config"


def server_urls(urls: str) -> list[str]:
    """``--nats-url`` / ``KVPUSH_NATS_URL`` as nats-py's server list: one URL, or several
    members of one NATS cluster separated by commas (``nats://h1:4222,nats://h2:4222``).
    nats-py tries them in random order and moves to another member when one goes away; it
    also learns members the cluster announces."""
    servers = [url.strip() for url in urls.split(",") if url.strip()]
    if not servers:
        raise NatsConfigError(f"no NATS URL in {urls!r}: give one URL or a comma-separated list")
    for url in servers:
        scheme = url.split("://", 1)[0] if "://" in url else None
        if scheme not in ("nats", "tls"):
            raise NatsConfigError(f"{url!r} is not a NATS URL: write nats://host:port (or tls://host:port)")
    return servers


def connect_options(env: Mapping[str, str] = os.environ, service: str | None = None) -> dict:
    """Keyword arguments for ``nats.connect(url, **connect_options())``; ``{}`` for an
    anonymous client when nothing is set. ``service``: the id of the service connecting.

    Raises NatsConfigError for a contradiction, so a misconfigured process fails at
    start-up with a sentence instead of with an authorization error from the server.
    """
    settings = _read(env)
    options = _auth_options(settings)
    tls = _tls_context(settings)
    if tls is not None:
        options["tls"] = tls
    user = settings.get("nats_user")
    if service is not None:
        options["inbox_prefix"] = permissions.service_inbox(service)
    elif user is not None:
        options["inbox_prefix"] = permissions.client_inbox(user)
    return options


def error_logger(who: str):
    """nats-py's ``error_cb`` for ``who``'s connection: one line per error, never a
    traceback. nats-py's default logs every failed reconnect with its traceback, which a
    connection still closing after its server stopped (a stop, an outage) prints over and
    over."""
    logger = logging.getLogger("kvpush.nats")

    async def on_error(exc: BaseException) -> None:
        logger.warning("NATS connection of %s: %s: %s", who, type(exc).__name__, exc)

    return on_error


def nats_user(env: Mapping[str, str] = os.environ) -> str | None:
    """The NATS user this process logs in as (``KVPUSH_NATS_USER``), if any: with
    per-identity users, a service's id."""
    return env.get(ENV_VARS["nats_user"]) or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--nats-*`` security flags; each one only overrides its environment variable."""
    for dest, env_name in ENV_VARS.items():
        flag = "--" + dest.replace("_", "-")
        parser.add_argument(flag, dest=dest, default=None, metavar=_metavar(dest),
                            help=f"{_HELP[dest]} (sets {env_name})")


def export_arguments(args: argparse.Namespace, env: MutableMapping[str, str] = os.environ) -> None:
    """Copy the given ``--nats-*`` flags into ``env`` so child processes inherit them.

    Paths are made absolute, because a child may run in another working directory.
    """
    for dest, env_name in ENV_VARS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        value = str(value)
        env[env_name] = os.path.abspath(value) if dest in _PATHS else value


def _read(env: Mapping[str, str]) -> dict[str, str]:
    return {dest: env[name] for dest, name in ENV_VARS.items() if env.get(name)}


def _auth_options(settings: dict[str, str]) -> dict:
    user, password = settings.get("nats_user"), settings.get("nats_password")
    if password is not None and user is None:
        raise NatsConfigError(f"{_label('nats_password')} is set but {_label('nats_user')} is not.")
    if user is not None and password is None:
        raise NatsConfigError(f"{_label('nats_user')} is set but {_label('nats_password')} is not.")
    methods = [dest for dest in ("nats_user", "nats_token", "nats_nkey_seed", "nats_creds") if dest in settings]
    if len(methods) > 1:
        raise NatsConfigError(
            f"choose one way to authenticate to NATS, not {' and '.join(_label(m) for m in methods)}.")
    if user is not None:
        return {"user": user, "password": password}
    if "nats_token" in settings:
        return {"token": settings["nats_token"]}
    if "nats_nkey_seed" in settings:
        return {"nkeys_seed": _existing_file(settings, "nats_nkey_seed")}
    if "nats_creds" in settings:
        return {"user_credentials": _existing_file(settings, "nats_creds")}
    return {}


def _tls_context(settings: dict[str, str]) -> ssl.SSLContext | None:
    """Verify the server (with the given CA, else the system's) and present a client certificate if given."""
    ca, cert, key = (settings.get(d) for d in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key"))
    if cert is not None and key is None:
        raise NatsConfigError(f"{_label('nats_tls_cert')} is set but {_label('nats_tls_key')} is not.")
    if key is not None and cert is None:
        raise NatsConfigError(f"{_label('nats_tls_key')} is set but {_label('nats_tls_cert')} is not.")
    if ca is None and cert is None:
        return None
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=_existing_file(settings, "nats_tls_ca") if ca else None)
        if cert is not None:
            context.load_cert_chain(_existing_file(settings, "nats_tls_cert"), _existing_file(settings, "nats_tls_key"),
                                    password=_refuse_passphrase)
    except ssl.SSLError as exc:
        raise NatsConfigError(f"the NATS TLS files could not be loaded: {exc}.") from exc
    return context


def _refuse_passphrase() -> str:
    """An encrypted key would make OpenSSL prompt on the terminal, which hangs a service."""
    raise NatsConfigError(f"{_label('nats_tls_key')} is encrypted; give an unencrypted key.")


def _existing_file(settings: dict[str, str], dest: str) -> str:
    path = settings[dest]
    if not os.path.isfile(path):
        raise NatsConfigError(f"{_label(dest)} names {path!r}, which is not a file.")
    return path


def _label(dest: str) -> str:
    return f"{ENV_VARS[dest]} (--{dest.replace('_', '-')})"


def _metavar(dest: str) -> str:
    return "PATH" if dest in _PATHS else dest.removeprefix("nats_").upper()
