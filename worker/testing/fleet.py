"""What the in-memory store keeps fleet-wide, outside any session, as the Redis store does
(``worker.session.fleet``): each agent's spend (one day: it is not aged) and the list of calls
waiting for a decision. Mixed into ``MemoryStore`` (``worker.testing.memory``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contracts import keys
from contracts.control import ApprovalRequest
from contracts.state import Spend
from worker.session.port import listed
from worker.testing.keyspace import Keyspace


class MemoryFleetLists:
    """Mixed into ``MemoryStore``: what it has that these use."""

    keys: Keyspace
    wall_clock: Callable[[], float]
    spend: dict[str, Spend]
    waiting_approvals: dict[str, ApprovalRequest]

    async def spent_today(self, agent: str) -> Spend:
        return self.spend.get(agent, Spend())

    async def add_spent(self, agent: str, spend: Spend) -> None:
        self.spend[agent] = self.spend.get(agent, Spend()) + spend

    async def note_approvals(self, requests: Sequence[ApprovalRequest]) -> None:
        self.keys.sweep()
        for r in requests:
            self.waiting_approvals[f"{r.turn_id}:{r.call_id}"] = r
        if self.waiting_approvals:
            key = keys.approvals_waiting()
            self.keys.written(key, self.waiting_approvals.clear)
            until = max((r.until for r in requests if r.until is not None), default=None)
            if until is not None:  # the hash expires with its latest wait (EXPIREAT NX, GT)
                self.keys.extend(key, until - self.wall_clock())

    async def clear_approvals(self, turn_id: str, call_ids: Sequence[str]) -> None:
        self.keys.sweep()
        for call_id in call_ids:
            self.waiting_approvals.pop(f"{turn_id}:{call_id}", None)
        if not self.waiting_approvals:
            self.keys.deleted(keys.approvals_waiting())

    async def approvals(self) -> list[ApprovalRequest]:
        self.keys.sweep()
        now = self.wall_clock()
        for field, r in list(self.waiting_approvals.items()):
            if not listed(r, now):
                del self.waiting_approvals[field]
        return sorted(self.waiting_approvals.values(), key=lambda r: r.since)
