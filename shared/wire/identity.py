"""Who may be named, and how a receiver checks who sent a message.

Core NATS never says who published a message, but the server can enforce who may publish
on which subject. So wherever a message says who sent it, the sender's identity is also
the last token of its subject (``{sender}`` in ``kvpush.shared.wire.subjects``), and the
receiver refuses the message if the two differ (``forged_sender``). With one NATS user per
worker (``kvpush.shared.permissions``, ``deploy/``), only that worker may publish under its
own name, and each worker may read only its own jobs. A worker's id is its NATS user; a
restart keeps the id and gets a new ``incarnation``.

Services take replies on inboxes under ``_KVPUSH_INBOX.<identity>``, out of clients' reach;
clients on inboxes under ``_INBOX.<client>``.

Pure: imports no NATS.
"""

from __future__ import annotations

import re

import msgspec

from kvpush.shared.wire.subjects import (CLIENT_INBOX_PREFIX, OWNED_CANCEL, OWNED_FINAL, OWNED_GENERATE, OWNED_STATUS,
                                         SERVICE_INBOX_PREFIX)

IDENTITY_PATTERN = r"[A-Za-z0-9_-]{1,64}"
"""A worker, scheduler or client name: one NATS subject token, no wildcards, no dots."""


def identity_problem(name: str) -> str | None:
    """Why ``name`` cannot be a kvpush identity (it becomes a subject token), or None."""
    if re.fullmatch(IDENTITY_PATTERN, name):
        return None
    return f"{name!r} is not a valid id: use 1-64 letters, digits, '-' and '_'"


MAX_REQUEST_ID_LEN = 128
REQUEST_ID_PATTERN = r"[-/_=.a-zA-Z0-9]+"  # NATS KV key characters: a request id keys its flight's record


def request_id_problem(request_id: str) -> str | None:
    """Why ``request_id`` cannot be a request's id, or None."""
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        return f"request_id must be 1 to {MAX_REQUEST_ID_LEN} characters"
    if not re.fullmatch(REQUEST_ID_PATTERN, request_id):
        return "request_id may hold only letters, digits and - / _ = . (no spaces or wildcards)"
    return None


def sender_of(subject: str) -> str:
    """The sender token of a subject that ends in one (the templates with ``{sender}``)."""
    return subject.rsplit(".", 1)[-1]


def forged_sender(subject: str, message: msgspec.Struct) -> str | None:
    """Why ``message`` must be refused because it names a sender other than the one its
    subject (which NATS lets only that sender publish on) proves; None if it is fine.
    A message kind without ``sender_field`` names nobody and is never forged."""
    field = getattr(type(message), "sender_field", None)
    if field is None:
        return None
    claimed = getattr(message, field)
    if claimed == sender_of(subject):
        return None
    return f"a {type(message).__name__} that says it is from {claimed!r} came on {subject}"


def owner_of(subject: str) -> str:
    """The client a request or cancel subject names (``kvpush.generate.<client>``), or ""."""
    for template in (OWNED_GENERATE, OWNED_CANCEL, OWNED_FINAL, OWNED_STATUS):
        base = template.split("{")[0]
        if subject.startswith(base):
            return subject[len(base):]
    return ""


def is_inbox(reply: str) -> bool:
    """A reply subject a service may answer on: an inbox, never one of kvpush's subjects
    (a server lets a responder publish on whatever reply subject it was given)."""
    return reply.startswith((CLIENT_INBOX_PREFIX + ".", SERVICE_INBOX_PREFIX + "."))


def reply_problem(reply: str, owner: str) -> str | None:
    """Why a client's reply subject is refused (it must be an inbox, the client's own when
    it is named), or None: output must never be pointed at an internal subject."""
    prefix = f"{CLIENT_INBOX_PREFIX}.{owner}." if owner else f"{CLIENT_INBOX_PREFIX}."
    if not reply.startswith(prefix) or "*" in reply or ">" in reply or " " in reply:
        return f"the reply subject {reply!r} must be an inbox under {prefix}"
    return None
