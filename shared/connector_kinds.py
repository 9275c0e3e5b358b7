"""The kinds of KV connector a worker's engine may run, and what each one supports: the
one table of them. Pure: no NATS, NIXL or vLLM.

- ``kvpush``: ours (``kvpush.connector.kvpush_connector``), over NATS and NIXL: push or pull,
  chosen per request.
- ``vllm-nixl``: vLLM's own ``NixlConnector``: pull only.
- ``vllm-nixl-push``: vLLM's own ``NixlPushConnector``: push only.

Any kind may also serve a request ``local`` (the decode computes the prompt: no transfer).

Who reads it: ``kvpush.shared.wire`` (the heartbeat's ``connector``), the scheduler (the modes a
flight may take), the worker (one strategy per kind: ``kvpush.services.worker.kinds``), the CLI
(``--connector``) and the bench (vLLM's connector classes, its proxy's flow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TransferMode = Literal["push", "pull"]  # how the KV crosses: decode's blocks written by prefill, or read by decode
Name = Literal["kvpush", "vllm-nixl", "vllm-nixl-push"]  # the registry's keys, as a type


@dataclass(frozen=True)
class ConnectorKind:
    name: Name  # on the wire (``WorkerHeartbeat.connector``) and the command line (``--connector``)
    modes: tuple[TransferMode, ...]  # the transfer modes it does
    vllm_connector: str | None = None  # vLLM's own connector class (``kv_connector``); None: ours

    @property
    def ours(self) -> bool:
        return self.vllm_connector is None


KVPUSH = ConnectorKind("kvpush", ("push", "pull"))
VLLM_NIXL = ConnectorKind("vllm-nixl", ("pull",), vllm_connector="NixlConnector")
VLLM_NIXL_PUSH = ConnectorKind("vllm-nixl-push", ("push",), vllm_connector="NixlPushConnector")

KINDS: dict[str, ConnectorKind] = {kind.name: kind for kind in (KVPUSH, VLLM_NIXL, VLLM_NIXL_PUSH)}
NAMES: tuple[str, ...] = tuple(KINDS)


def of(name: str) -> ConnectorKind:
    """The kind called ``name``; ValueError for a name that is none of ``NAMES``."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown KV connector kind {name!r}: one of {', '.join(NAMES)}") from None
