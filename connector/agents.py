"""The peers' NIXL agents a worker rank copies to or from: learnt from announcements
(``kvpush.kv.agents``, sent once when a rank is ready), or asked for on first contact
(``kvpush.kv.agent.<engine_id>.<rank>``). Rank r talks to rank r of its peer engine."""

from __future__ import annotations

import threading
from typing import Callable

from connector.bridge import NatsBridge
from shared import wire

ASK_TIMEOUT_S = 5.0  # a peer rank that does not answer this fast is unreachable


class AgentDirectory:
    def __init__(self, bridge: NatsBridge, rank: int, service: str):
        self.bridge = bridge
        self.rank = rank
        self.service = service  # who refuses a bad reply on kvpush.invalid
        self._agents: dict[tuple[str, int], wire.AgentInfo] = {}
        self._agents_lock = threading.Lock()  # protects _agents

    def on_announced(self, info: wire.AgentInfo) -> None:
        with self._agents_lock:
            self._agents[(info.engine_id, info.rank)] = info  # a restarted peer replaces its old agent

    def with_agent(self, engine_id: str, then: Callable[[wire.AgentInfo | None, str], None]) -> None:
        """Call ``then(info, "")`` with the peer rank's agent, asking for it over NATS on
        first contact; ``then(None, why)`` if it cannot be had."""
        key = (engine_id, self.rank)
        with self._agents_lock:
            known = self._agents.get(key)
        if known is not None:
            then(known, "")
            return
        subject = wire.agent_subject(*key)

        def on_reply(data: bytes | None, error: str | None) -> None:
            if error is not None:
                then(None, error)
                return
            info = self.bridge.decoded(data, wire.AgentInfo, subject, self.service)
            if info is None:
                then(None, f"bad agent info on {subject}")
                return
            with self._agents_lock:
                self._agents[key] = info
            then(info, "")

        self.bridge.request_async(subject, b"", ASK_TIMEOUT_S, on_reply)
