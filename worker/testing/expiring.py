"""The in-memory store's expiry rules, as the Redis store's scripts keep them
(``worker.session.scripts``): which entries a write keeps alive, for how long, and what
Redis drops. Mixed into ``MemoryStore`` (``worker.testing.memory``); its entries are
registered in a ``Keyspace`` under their Redis keys' names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from contracts import keys
from contracts.base import Contract
from contracts.state import AgentState
from contracts.turns import TurnResult
from worker.session.port import lifetime
from worker.testing.keyspace import Keyspace

_K = TypeVar("_K")


class ExpiryRules:
    """Mixed into ``MemoryStore``: what it has that these use."""

    keys: Keyspace
    ttl_s: float
    wall_clock: Callable[[], float]
    results: dict[tuple[str, str], TurnResult]
    controls: dict[tuple[str, str], dict[str, Contract | int]]

    def _index_lives(self, turn_id: str, lifetime: float) -> None:
        """``EXPIRE`` of the turn's session index, with every save of the turn: twice the
        lifetime the save gives the session's keys (the index outlives every key of its turn)."""
        if turn_id:
            self.keys.expire(keys.turn_session(turn_id), 2 * lifetime)

    def _set_result(self, sid: str, turn_id: str, result: TurnResult) -> None:
        self.results[sid, turn_id] = result
        key = keys.turn_result(sid, turn_id)
        self.keys.expire(key, self.ttl_s, self._pop(self.results, (sid, turn_id)))

    def _expire_controls(self, key: tuple[str, str]) -> None:
        self._expire(keys.turn_controls(*key), self._pop(self.controls, key))

    def _drop_controls(self, key: tuple[str, str]) -> None:
        self.controls.pop(key, None)
        self.keys.deleted(keys.turn_controls(*key))

    def _expire(self, key: str, drop: Callable[[], None]) -> None:
        """``key`` written, and kept alive at least ``ttl_s`` more."""
        self.keys.written(key, drop)
        self.keys.extend(key, self.ttl_s)

    def _kept(self, sid: str, turn_id: str = "") -> list[str]:
        """The session's keys that every script naming the session keeps alive (and a turn's
        controls and ``persist: false`` list)."""
        names = [
            keys.session_state(sid),
            keys.session_history(sid),
            keys.session_fence(sid),
            keys.session_queue(sid),
            keys.session_turns(sid),
            keys.session_requests(sid),
            keys.session_replies(sid),
        ]
        if turn_id:
            names += [
                keys.turn_controls(sid, turn_id),
                keys.turn_steps(sid, turn_id),
                keys.turn_transient(sid, turn_id),
            ]
        return names

    def _keep(self, lifetime: float, names: Sequence[str]) -> None:
        """Each of ``names`` that exists lives at least ``lifetime`` more (the scripts' keep)."""
        for name in names:
            self.keys.extend(name, lifetime)

    def _lifetime(self, state: AgentState) -> float:
        """How long a save of ``state`` keeps the session's keys (as the Redis store's)."""
        return lifetime(state, self.ttl_s, self.wall_clock())

    def _emptied(self, key: str, table: dict[str, Any], sid: str) -> None:
        """Redis drops an emptied list or hash, with its expiry."""
        if sid in table and not table[sid]:
            del table[sid]
            self.keys.deleted(key)

    @staticmethod
    def _pop(table: dict[_K, Any], key: _K) -> Callable[[], None]:
        """What deletes the entry ``key`` of ``table`` (the key's expiry)."""

        def drop() -> None:
            table.pop(key, None)

        return drop
