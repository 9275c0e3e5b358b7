"""The subject table (``wire.SUBJECTS``, ``wire.DURABLE``): every subject the wire package
defines has its row, each row's roles and types are real, the NATS permissions derived from
it are the ones written by hand before it existed, and docs/protocol.md says the same."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import get_args

import msgspec
import pytest

from kvpush.shared import permissions, wire

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROUTES = (*wire.SUBJECTS, *wire.DURABLE)
ROLES = get_args(wire.IdentityRole)

# What permissions() granted when it was written by hand, role by role (``<name>``: the
# user's name), copied from its output once: a regression pin, the derived lists must hold
# exactly these, in any order.
HAND_WRITTEN = json.loads((Path(__file__).parent / "data" / "hand_written_permissions.json").read_text())


@pytest.mark.parametrize("role, name", [(role, name) for role in HAND_WRITTEN
                                        for name in (f"{role}-0", "x_9-Z")])
def test_the_derived_permissions_are_the_hand_written_ones(role, name):
    rules = permissions.permissions(role, name)
    expected = HAND_WRITTEN[role]
    assert sorted(rules.publish) == sorted(s.replace("<name>", name) for s in expected["publish"])
    assert sorted(rules.subscribe) == sorted(s.replace("<name>", name) for s in expected["subscribe"])
    assert rules.allow_responses is expected["allow_responses"]


def _defined() -> dict[str, str]:
    """Every subject the wire package defines, by where: its templates and trees, its
    fixed subjects (``*_SUBJECT``) and inbox prefixes (``*_INBOX_PREFIX``)."""
    found = {}
    for module_info in pkgutil.iter_modules(wire.__path__):
        module = importlib.import_module(f"{wire.__name__}.{module_info.name}")
        for attribute, value in vars(module).items():
            if isinstance(value, (wire.SubjectTemplate, wire.SubjectTree)) or (
                    isinstance(value, str) and attribute.endswith(("_SUBJECT", "_INBOX_PREFIX"))):
                found[f"{module_info.name}.{attribute}"] = value
    return found


def test_every_subject_the_wire_package_defines_has_one_row_with_its_roles():
    defined = _defined()
    assert {"subjects.LEND_JOBS", "subjects.GENERATE_SUBJECT", "durable.DECODE_CLAIMS"} <= set(defined)
    for where, subject in defined.items():
        rows = [route for route in ROUTES if route.subject == subject]
        assert len(rows) == 1, f"{where} ({subject}) has {len(rows)} rows in wire.SUBJECTS and wire.DURABLE"
    for route in wire.SUBJECTS:
        assert route.publishers and route.subscribers, route.pattern
        assert route.messages or route.replies, route.pattern
    for route in wire.DURABLE:
        assert route.publishers and not route.subscribers, route.pattern
    for bucket in (wire.FLIGHTS_BUCKET, wire.FINALS_BUCKET):
        assert [route.store for route in wire.DURABLE].count(bucket) == 1


def test_every_use_is_of_a_role_and_names_parts_its_subject_has():
    for route in ROUTES:
        for use in (*route.publishers, *route.subscribers):
            assert use.role in ROLES, route.pattern
            if use.grant is wire.Grant.OWN and isinstance(route.subject, wire.SubjectTemplate):
                assert use.parts and set(use.parts) <= set(route.subject.parts), (route.pattern, use)
            elif use.grant is wire.Grant.OWN:
                assert isinstance(route.subject, wire.SubjectTree) and not use.parts, (route.pattern, use)
            else:
                assert not use.parts, (route.pattern, use)
        assert not any(use.answers for use in route.publishers), route.pattern


def test_every_type_named_is_a_wire_struct_and_a_self_naming_one_travels_under_its_senders_own_name():
    for route in ROUTES:
        for name in (*route.messages, *route.replies):
            assert isinstance(getattr(wire, name, None), type) and issubclass(getattr(wire, name), msgspec.Struct), name
        named = [name for name in route.messages if getattr(getattr(wire, name), "sender_field", None)]
        if named and isinstance(route.subject, wire.SubjectTemplate):
            assert route.subject.endswith(".{sender}"), (route.pattern, named)
            assert all(use.grant is wire.Grant.OWN and "sender" in use.parts for use in route.publishers), route.pattern


def test_claimants_publish_on_the_claim_subjects_the_table_grants():
    key = wire.claim_key("secret")
    assert wire.Claimant.decode("decode-3").subject("decode-3", key) == \
        wire.DECODE_CLAIMS(decode="decode-3", key=key, sender="decode-3")
    assert wire.Claimant.scheduler("scheduler-1", "inc").subject("decode-3", key) == \
        wire.SCHEDULER_CLAIMS(decode="decode-3", key=key, sender="scheduler-1", incarnation="inc")
    assert wire.Claimant.scheduler("scheduler-1", "inc").subject("", key) == \
        wire.SCHEDULER_CLAIMS(decode=wire.NO_DECODE, key=key, sender="scheduler-1", incarnation="inc")


# --------------------------------------------------------------------------- docs/protocol.md

def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line is ``header``."""
    lines = text.splitlines()
    start = lines.index(header) + 2  # past the header and its --- line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def _uses(cell: str) -> list[str]:
    return re.split(r",\s*(?![^()]*\))", cell) if cell else []


def _names(cell: str) -> tuple[str, ...]:
    return () if cell in ("", "-", "(empty)") else tuple(cell.split(", "))


def _message_row(route: wire.Route) -> tuple:
    return (route.messages, route.replies, [use.label for use in route.publishers],
            [use.label for use in route.subscribers], route.meaning)


def _parsed_message_row(messages: str, roles: str, meaning: str) -> tuple:
    sent, _, replies = messages.partition("; reply: ")
    publishers, subscribers = roles.split(" -> ")
    return (_names(sent), _names(replies), _uses(publishers), _uses(subscribers), meaning)


def test_docs_protocol_has_the_code_tables_row_for_row():
    text = (ROOT / "docs" / "protocol.md").read_text()
    subjects = _table(text, "| subject | messages | publishers -> subscribers | meaning |")
    documented = {subject.strip("`"): _parsed_message_row(*rest) for subject, *rest in subjects}
    assert len(documented) == len(subjects), "a subject has two rows in docs/protocol.md"
    assert set(documented) == {route.pattern for route in wire.SUBJECTS}
    for route in wire.SUBJECTS:
        assert documented[route.pattern] == _message_row(route), route.pattern

    durable = _table(text, "| subject | kept in | value | writers | meaning |")
    documented = {subject.strip("`"): (store, _names(value), _uses(writers), meaning)
                  for subject, store, value, writers, meaning in durable}
    assert len(documented) == len(durable), "a subject has two rows in docs/protocol.md"
    assert set(documented) == {route.pattern for route in wire.DURABLE}
    for route in wire.DURABLE:
        expected = (route.store or "-", route.messages, [use.label for use in route.publishers], route.meaning)
        assert documented[route.pattern] == expected, route.pattern


def test_docs_protocol_names_the_current_version():
    text = (ROOT / "docs" / "protocol.md").read_text()
    assert f"`wire.PROTOCOL_VERSION` is {wire.PROTOCOL_VERSION}." in text
    assert re.search(rf"^{wire.PROTOCOL_VERSION}\. ", text, re.MULTILINE)
