"""``TenantSlots`` in memory (``worker.session.tenant_slots``), for the sequencer's simulation:
the same answers as the Redis scripts, each call one step (as a script is atomic).
``tests/integration/test_tenant_fairness.py`` holds both to one scenario."""

from __future__ import annotations

from collections.abc import Mapping

from worker.session.tenant_slots import RESEND_S, SlotCaps


class _Tenant:
    def __init__(self) -> None:
        self.running: dict[str, float] = {}
        """Turn id -> when its slot lapses."""
        self.line: list[str] = []
        self.sessions: dict[str, str] = {}
        self.starting: dict[str, float] = {}


class MemoryTenantSlots(SlotCaps):
    def __init__(
        self,
        *,
        default_cap: int = 0,
        limits: Mapping[str, int] | None = None,
        lapse_s: float = 30 * 24 * 3600,
    ) -> None:
        super().__init__(default_cap=default_cap, limits=limits, lapse_s=lapse_s)
        self.tenants: dict[str, _Tenant] = {}

    async def admit(
        self, tenant: str, turn_id: str, session_id: str, now: float
    ) -> tuple[bool, list[tuple[str, str]]]:
        t = self.tenants.setdefault(tenant, _Tenant())
        lapse = now + self.lapse_s
        if turn_id in t.running:
            t.starting.pop(turn_id, None)
            t.sessions.pop(turn_id, None)
        woken = self._fill(t, self.cap(tenant), now, lapse, self._resend(t, now - RESEND_S))
        if turn_id in t.running:
            if t.sessions.pop(turn_id, None) is not None:  # handed a slot just now
                t.starting.pop(turn_id, None)
                woken = [w for w in woken if w[0] != turn_id]
            return True, woken
        if turn_id in t.sessions:
            return False, woken
        if not t.line and len(t.running) < self.cap(tenant):
            t.running[turn_id] = lapse
            return True, woken
        t.sessions[turn_id] = session_id
        t.line.append(turn_id)
        return False, woken

    async def release(self, tenant: str, turn_id: str, now: float) -> list[tuple[str, str]]:
        t = self.tenants.setdefault(tenant, _Tenant())
        t.running.pop(turn_id, None)
        t.starting.pop(turn_id, None)
        if t.sessions.pop(turn_id, None) is not None and turn_id in t.line:
            t.line.remove(turn_id)
        woken = self._resend(t, float("inf"))
        return self._fill(t, self.cap(tenant), now, now + self.lapse_s, woken)

    async def in_line(self, tenant: str, turn_id: str) -> bool:
        return turn_id in self.tenants.setdefault(tenant, _Tenant()).sessions

    @staticmethod
    def _resend(t: _Tenant, before: float) -> list[tuple[str, str]]:
        woken = []
        for turn, at in sorted(t.starting.items(), key=lambda item: (item[1], item[0])):
            if at > before:
                continue
            session = t.sessions.get(turn)
            if session is not None and turn in t.running:
                woken.append((turn, session))
            else:
                del t.starting[turn]
        return woken

    @staticmethod
    def _fill(
        t: _Tenant, cap: int, now: float, lapse: float, woken: list[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        for turn in [turn for turn, until in t.running.items() if until <= now]:
            del t.running[turn]
        while len(t.running) < cap and t.line:
            turn = t.line.pop(0)
            session = t.sessions.get(turn)
            if session is not None:
                t.running[turn] = lapse
                t.starting[turn] = now
                woken.append((turn, session))
        return woken
