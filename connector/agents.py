"""The peers' NIXL agents a worker rank copies to or from: learnt from announcements
(``kvpush.kv.agents.<engine_id>``, sent once when a rank is ready), or asked for on first
contact (``kvpush.kv.agent.<engine_id>.<rank>``). A rank talks to the ranks of its peer
engine whose KV heads overlap its own (``kvpush.connector.tp_map``): at equal
tensor-parallel sizes rank r to rank r, else one rank to several (``with_agents``).

Only the engine itself may publish its announcements and answer its agent subject (NATS
permissions, ``kvpush.shared.permissions``); the bridge refuses an announcement whose engine id
is not its subject's, and a reply that is not the agent asked for is refused here. An
engine keeps its id across restarts, so a copy names the incarnation it was set up
with (a registration's, a prefilled prompt's): an agent of another start has other
memory and is never used for it.
"""

from __future__ import annotations

import threading
from typing import Callable

from kvpush.connector.bridge import NatsBridge
from kvpush.shared import errors, wire

ASK_TIMEOUT_S = 5.0  # a peer rank that does not answer this fast is unreachable
MAX_AGENTS = 4_096  # peer agents remembered; the least recently learnt go first (asked again if needed)

Then = Callable[[wire.AgentInfo | None, str], None]
ThenAll = Callable[[list[wire.AgentInfo] | None, str], None]


class AgentDirectory:
    def __init__(self, bridge: NatsBridge, rank: int, service: str):
        self.bridge = bridge
        self.rank = rank
        self.service = service  # who refuses a bad reply on kvpush.invalid
        self._agents: dict[tuple[str, int], wire.AgentInfo] = {}
        self._agents_lock = threading.Lock()  # protects _agents

    def on_announced(self, info: wire.AgentInfo) -> None:
        self._remember((info.engine_id, info.rank), info)  # a restarted peer replaces its old agent

    def _remember(self, key: tuple[str, int], info: wire.AgentInfo) -> None:
        with self._agents_lock:
            self._agents.pop(key, None)
            self._agents[key] = info
            while len(self._agents) > MAX_AGENTS:
                del self._agents[next(iter(self._agents))]

    def __len__(self) -> int:
        with self._agents_lock:
            return len(self._agents)

    def with_agents(self, engine_id: str, ranks: list[int], then: ThenAll, incarnation: str = "") -> None:
        """Call ``then(infos, "")`` once every one of the peer's ``ranks`` has its agent (in
        the order asked), or ``then(None, why)`` once, at the first that cannot be had."""
        found: dict[int, wire.AgentInfo] = {}
        lock = threading.Lock()  # protects found (answers come on the bridge thread, or at once)
        failed: list[str] = []

        def on_agent(rank: int, info: wire.AgentInfo | None, why: str) -> None:
            with lock:
                if failed:
                    return
                if info is None:
                    failed.append(why)
                else:
                    found[rank] = info
                    if len(found) < len(ranks):
                        return
            then(None, why) if info is None else then([found[r] for r in ranks], "")

        for rank in ranks:
            self.with_agent(engine_id, lambda info, why, rank=rank: on_agent(rank, info, why), incarnation,
                            rank=rank)

    def with_agent(self, engine_id: str, then: Then, incarnation: str = "", fresh: bool = False,
                   rank: int | None = None) -> None:
        """Call ``then(info, "")`` with the agent of the peer's ``rank`` (default: ours), of
        ``incarnation`` if given, asking for it over NATS unless it is known (and not
        ``fresh``); ``then(None, why)`` if it cannot be had."""
        key = (engine_id, self.rank if rank is None else rank)
        with self._agents_lock:
            known = self._agents.get(key)
        if known is not None and not fresh and (not incarnation or known.incarnation == incarnation):
            then(known, "")
            return
        subject = wire.agent_subject(*key)

        def on_reply(data: bytes | None, error: str | None) -> None:
            if error is not None:
                then(None, error)
                return
            info = self.bridge.decoded(data, wire.AgentInfo, subject, self.service, reply=True)
            if info is None:
                then(None, f"bad agent info on {subject}")
                return
            if (info.engine_id, info.rank) != key:
                why = f"asked {subject}, the answer is the agent of {info.engine_id} rank {info.rank}"
                self.bridge.refuse(errors.refusal(self.service, subject, ValueError(why), errors.WrongParty))
                then(None, why)
                return
            self._remember(key, info)
            if incarnation and info.incarnation != incarnation:
                then(None, f"{engine_id} restarted: the copy was set up with its incarnation {incarnation}, "
                           f"it now runs {info.incarnation}")
                return
            then(info, "")

        self.bridge.request_async(subject, b"", ASK_TIMEOUT_S, on_reply)
