"""What an MCP caller hears of a turn while it runs: its events as progress notifications.

A caller that gives a ``progressToken`` gets one ``notifications/progress`` per event worth
telling (the turn accepted and started, each tool call, each step, each sub-agent, a budget
spent), its ``progress`` counting them (no ``total``: a turn's length is not known). Streamed
text is not sent: the answer comes with the result.

A turn parked for a human decision is never silent: each ``approval.requested`` says which
call waits, for which tool, until when and how to decide it, and the same is said again every
``remind_every_s`` while a call still waits (clients may reset their request timeout on
progress), until ``approval.decided`` or the turn's end. The waiting is also sent as a log
message (``notifications/message``, level ``warning``) to callers that receive them (the
deprecated logging capability: before 2026-07-28 always, from then on when the request opts
in), for callers that gave no progress token.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from mcp.shared.exceptions import MCPDeprecationWarning

from contracts.client import TurnHandle
from contracts.events import (
    ApprovalDecided,
    ApprovalRequested,
    BudgetExhausted,
    ChildFinished,
    ChildStarted,
    Event,
    StepCompleted,
    ToolInvoked,
    ToolInvoking,
)

log = logging.getLogger("loopwire.mcp")


class Session(Protocol):
    """The part of the SDK's request-scoped ``ServerSession`` a turn's progress uses."""

    async def report_progress(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> None: ...

    async def send_log_message(
        self, level: Any, data: Any, logger: str | None = None, related_request_id: Any = None
    ) -> None: ...


def describe(event: Event) -> str | None:
    """One line for the caller, or ``None`` for an event it need not hear."""
    data = event.data
    if event.type == "turn.accepted":
        return f"turn {event.turn_id} accepted"
    if event.type == "turn.started":
        return "started"
    if isinstance(data, ToolInvoking):
        return f"calling tool {data.tool}"
    if isinstance(data, ToolInvoked):
        return f"tool {data.tool}: {data.outcome} in {data.duration_s:.2f} s"
    if isinstance(data, StepCompleted):
        number = (event.step or 0) + 1  # counted from 1 for people; the event's from 0
        return f"step {number} done: {data.step_type}, {data.tool_calls} tool call(s)"
    if isinstance(data, ChildStarted):
        return f"asked agent {data.agent}"
    if isinstance(data, ChildFinished):
        return f"agent {data.agent} answered: {data.finish_reason}"
    if isinstance(data, ApprovalDecided):
        by = f" by {data.by}" if data.by else ""
        return f"call {data.call_id}: {data.decision}{by}"
    if isinstance(data, BudgetExhausted):
        return f"budget {data.budget} spent ({data.used:g} of {data.limit:g})"
    return None


def waiting_line(turn_id: str, request: ApprovalRequested) -> str:
    until = ""
    if request.until is not None:
        at = datetime.fromtimestamp(request.until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        until = f" until {at}"
    return (
        f"waiting for a human decision on call {request.call_id} (tool {request.tool}){until}; "
        f"decide with: loopwire approve|reject {turn_id} {request.call_id}"
    )


class TurnProgress:
    """Follows one turn's events and tells the caller (``run``), reminding it of the calls that
    wait for a decision (``remind``). ``waiting`` changes feed the metrics."""

    def __init__(
        self,
        session: Session,
        handle: TurnHandle,
        *,
        remind_every_s: float,
        request_id: str | int | None = None,
        on_waiting: Callable[[bool], None] = lambda _: None,
        on_sent: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.session = session
        self.handle = handle
        self.remind_every_s = remind_every_s
        self.request_id = request_id
        self.on_waiting = on_waiting
        self.on_sent = on_sent
        self.clock = clock
        self.sent = 0
        self.waiting: dict[str, ApprovalRequested] = {}

    async def run(self) -> None:
        """Until the turn's final event (or cancelled)."""
        reminder = asyncio.create_task(self._remind())
        try:
            async for event in self.handle.events():
                await self._on_event(event)
        finally:
            reminder.cancel()
            self._set_waiting({})

    async def _on_event(self, event: Event) -> None:
        data = event.data
        if isinstance(data, ApprovalRequested):
            self._set_waiting({**self.waiting, data.call_id: data})
            await self._tell_waiting(data)
            return
        if isinstance(data, ApprovalDecided):
            self._set_waiting({k: v for k, v in self.waiting.items() if k != data.call_id})
        line = describe(event)
        if line is not None:
            await self._progress(line)

    async def _remind(self) -> None:
        while True:
            await asyncio.sleep(self.remind_every_s)
            for request in list(self.waiting.values()):
                if request.until is None or request.until > self.clock():
                    await self._tell_waiting(request)

    async def _tell_waiting(self, request: ApprovalRequested) -> None:
        line = waiting_line(self.handle.turn_id, request)
        await self._progress(line)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MCPDeprecationWarning)
                await self.session.send_log_message(
                    "warning", line, logger="loopwire", related_request_id=self.request_id
                )
        except Exception as exc:  # the caller went away: its request is cancelled next
            log.debug("could not send a log message: %r", exc)

    async def _progress(self, line: str) -> None:
        self.sent += 1
        self.on_sent()
        try:
            await self.session.report_progress(self.sent, message=line)
        except Exception as exc:
            log.debug("could not send progress: %r", exc)

    def _set_waiting(self, waiting: dict[str, ApprovalRequested]) -> None:
        before = bool(self.waiting)
        self.waiting = waiting
        if before != bool(waiting):
            self.on_waiting(bool(waiting))
