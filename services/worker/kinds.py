"""What each kind of KV connector (``kvpush.shared.connector_kinds``) asks of the worker: one
strategy per kind, picked by name with ``strategy(name)``.

- ``transfer_kwargs(engine)``: the engine arguments that load the connector
  (``kv_transfer_config`` and what goes with it); only for an engine with a role.
- ``prefill_request(job, traceparent)``: (engine request id, ``kv_transfer_params``) of a
  prefill job.
- ``decode_request(job, traceparent)``: the same for a decode job; a ``local`` one (no
  prefill, no transfer) is the same for every kind.
- ``side_channel(engine_id, tp_size)``: set up what peers reach this engine's connector by
  (an engine of ``tp_size`` ranks), and return it for the heartbeat's ``kv_params``.
- ``wake_engine(engine)``: tell the engine's connector that a request is being handed to
  the engine.

kvpush's connector reads the ``kvpush.shared.wire`` kv-params structs and speaks NATS. vLLM's are
driven the way its examples drive them: prefill and decode share the request id (the
transfer id), and decode gets the prefill's address (push) or what the prefill engine
returned (pull), verbatim; they talk over a side channel of their own.
"""

from __future__ import annotations

import os
import random
import socket
from abc import ABC, abstractmethod
from typing import ClassVar

import msgspec

from kvpush.services.worker.engine_settings import EngineSettings
from kvpush.shared import connector_kinds, wire
from kvpush.shared.connector_kinds import ConnectorKind


class KindStrategy(ABC):
    """What the worker does differently per connector kind; the contracts are above."""

    kind: ClassVar[ConnectorKind]

    @abstractmethod
    def transfer_kwargs(self, engine: EngineSettings) -> dict:
        ...

    @abstractmethod
    def prefill_request(self, job: wire.PrefillJob, traceparent: str) -> tuple[str, dict]:
        ...

    def decode_request(self, job: wire.DecodeJob, traceparent: str) -> tuple[str, dict]:
        if job.mode == "local":
            return f"{job.request_id}-l-{job.transfer_id[:8]}", {}
        return self.remote_decode_request(job, traceparent)

    @abstractmethod
    def remote_decode_request(self, job: wire.DecodeJob, traceparent: str) -> tuple[str, dict]:
        """A decode job whose prompt's KV comes from a prefill engine (push or pull)."""

    @abstractmethod
    def side_channel(self, engine_id: str, tp_size: int = 1) -> dict:
        ...

    @abstractmethod
    def wake_engine(self, engine: EngineSettings) -> None:
        ...


class KvpushStrategy(KindStrategy):
    kind = connector_kinds.KVPUSH

    def transfer_kwargs(self, engine: EngineSettings) -> dict:
        faults = engine.faults
        connector_config = wire.ConnectorConfig(nats_url=engine.nats_url, lease_s=faults.lease_s,
                                                kv_wait_s=faults.kv_wait_s, quarantine_s=faults.quarantine_s,
                                                incarnation=engine.incarnation, push_by_layer=engine.push_by_layer,
                                                role=engine.role)
        return {
            "kv_transfer_config": {
                "kv_connector": "KvpushConnector",
                "kv_connector_module_path": "kvpush.connector.kvpush_connector",
                # Both halves on every engine: a prefill also READs a prefix another engine
                # holds (``wire.Fetch``), a decode also lends its cached prefixes (``wire.LendJob``).
                "kv_role": "kv_both",
                "engine_id": engine.engine_id,
                "kv_connector_extra_config": msgspec.to_builtins(connector_config),
                # Decode: vLLM ends a request whose KV did not arrive (an "error" finish) and the
                # decode worker applies the request's own kv_policy: it computes the prompt
                # itself, or fails the request (services/worker/decode.py). Prefill: a fetched
                # prefix that did not arrive is computed, as if it had not been fetched.
                "kv_load_failure_policy": "recompute" if engine.role == "prefill" else "fail",
            },
            "disable_hybrid_kv_cache_manager": True,
        }

    def prefill_request(self, job: wire.PrefillJob, traceparent: str) -> tuple[str, dict]:
        params = wire.PrefillKvParams(transfer_id=job.transfer_id, mode=job.mode,
                                      decode_engine_id=job.decode_engine_id, traceparent=traceparent,
                                      transfer_key=job.transfer_key, checksum=job.kv_checksum)
        kv_params = params.as_params()
        if job.fetch is not None:
            kv_params[wire.FETCH_KEY] = fetch_params(job.fetch, job.request_id, traceparent)
        return f"{job.request_id}-p-{job.transfer_id[:8]}", kv_params

    def lend_request(self, job: wire.LendJob, traceparent: str) -> tuple[str, dict]:
        """A lend: the holder's engine runs the prefix (its cache holds it) as a pull-mode
        prefill and holds its blocks for the reader's READ, under the reader's lease."""
        params = wire.PrefillKvParams(transfer_id=job.transfer_id, mode="pull", traceparent=traceparent,
                                      transfer_key=job.transfer_key)
        return f"{job.request_id}-x-{job.transfer_id[:8]}", params.as_params()

    def remote_decode_request(self, job: wire.DecodeJob, traceparent: str) -> tuple[str, dict]:
        params = wire.DecodeKvParams(transfer_id=job.transfer_id, request_id=job.request_id,
                                     prefill_engine_id=job.prefill_engine_id, mode=job.mode, traceparent=traceparent,
                                     transfer_key=job.transfer_key, prefill_incarnation=job.prefill_incarnation)
        if job.mode == "pull":
            prefilled = wire.PrefilledKv.of(job.kv_transfer_params)
            params.prefill_tp_size = prefilled.prefill_tp_size
            params.remote_block_ids = prefilled.remote_block_ids
            params.block_digests = prefilled.block_digests
            params.head_digests = prefilled.head_digests  # per block and KV head: what a decode at any TP checks
            params.prefill_incarnation = prefilled.prefill_incarnation
        return f"{job.request_id}-d-{job.transfer_id[:8]}", params.as_params()

    def side_channel(self, engine_id: str, tp_size: int = 1) -> dict:
        return {}  # ours speaks NATS

    def wake_engine(self, engine: EngineSettings) -> None:
        """An engine whose requests only wait for transfers sits in a long wait (see
        ``kvpush.connector.engine_wake``). Costs a datagram per rank; a missing listener is not an
        error."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.setblocking(False)
            for rank in range(engine.tensor_parallel_size):
                try:
                    sender.sendto(b"\0", wire.engine_wake_address(engine.engine_id, engine.incarnation, rank))
                except OSError:
                    pass


class VllmNixlStrategy(KindStrategy):
    """vLLM's ``NixlConnector``: decode pulls; its params are what the prefill engine returned."""

    kind = connector_kinds.VLLM_NIXL

    def transfer_kwargs(self, engine: EngineSettings) -> dict:
        # Configured the way vLLM's examples run it.
        return {"kv_transfer_config": {"kv_connector": self.kind.vllm_connector, "kv_role": "kv_both",
                                       "engine_id": engine.engine_id}}

    def prefill_request(self, job: wire.PrefillJob, traceparent: str) -> tuple[str, dict]:
        return job.transfer_id, {"do_remote_decode": True}

    def remote_decode_request(self, job: wire.DecodeJob, traceparent: str) -> tuple[str, dict]:
        return job.transfer_id, dict(job.kv_transfer_params)

    def side_channel(self, engine_id: str, tp_size: int = 1) -> dict:
        """One port per engine, for this process's engine, whatever its TP (vLLM's scheduler
        side answers for every rank); the heartbeat names where other hosts reach it
        (``KVPUSH_ADVERTISE_HOST``) and the engine's TP, which a peer's connector maps its
        ranks by."""
        port = port_outside_ephemeral_range()
        host = os.environ.get("KVPUSH_ADVERTISE_HOST") or "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        return {"remote_engine_id": engine_id, "remote_host": host, "remote_port": port, "tp_size": tp_size}

    def wake_engine(self, engine: EngineSettings) -> None:
        pass  # vLLM's connectors have no ear for it


class VllmNixlPushStrategy(VllmNixlStrategy):
    """vLLM's ``NixlPushConnector``: decode is told the prefill's address (its heartbeat's
    ``kv_params``) and its request id, the transfer id both share."""

    kind = connector_kinds.VLLM_NIXL_PUSH

    def remote_decode_request(self, job: wire.DecodeJob, traceparent: str) -> tuple[str, dict]:
        return job.transfer_id, {"do_remote_prefill": True, "remote_request_id": job.transfer_id,
                                 **job.kv_transfer_params}


def fetch_params(fetch: wire.Fetch, request_id: str, traceparent: str) -> dict:
    """The engine request's READ of a prefix from its holder (``wire.FETCH_KEY``)."""
    lent = wire.PrefilledKv.of(fetch.lent)
    read = wire.DecodeKvParams(transfer_id=fetch.transfer_id, request_id=request_id,
                               prefill_engine_id=fetch.holder_engine_id, prefill_tp_size=lent.prefill_tp_size,
                               mode="pull", remote_block_ids=lent.remote_block_ids, traceparent=traceparent,
                               transfer_key=fetch.transfer_key, prefill_incarnation=lent.prefill_incarnation)
    return {**read.as_params(), "tokens": fetch.tokens}


STRATEGIES: dict[str, KindStrategy] = {
    strategy.kind.name: strategy for strategy in (KvpushStrategy(), VllmNixlStrategy(), VllmNixlPushStrategy())}


def strategy(name: str) -> KindStrategy:
    """The strategy of the connector kind ``name``; ValueError for an unknown one."""
    return STRATEGIES[connector_kinds.of(name).name]


def wake_engine(engine: EngineSettings) -> None:
    """Tell the engine's connector that a request is being handed to the engine (only
    kvpush's listens: see ``kvpush.connector.engine_wake``)."""
    if engine.role is not None:
        strategy(engine.connector).wake_engine(engine)


def port_outside_ephemeral_range() -> int:
    """A free port below the kernel's ephemeral range. vLLM's engine binds the side channel
    seconds after it is chosen, while it and its peer pick their own ports with bind(0),
    which the kernel takes from that range: a port chosen there could be handed out again
    meanwhile (CI saw "Address already in use"). None of theirs lands below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} for vLLM's NIXL side channel")
