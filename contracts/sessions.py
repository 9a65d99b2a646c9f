"""Sessions as a resource: read a session's history, its summary, its turns, a turn's result
and the records of a turn's steps, or delete the session, from any language through the broker.

Reads are a ``SessionQuery`` published to the queue ``loopwire.sessions`` with ``reply_to``
and a ``correlation_id``; any worker answers with a ``SessionReply`` (same correlation id).
A read takes no lease and never waits for a running turn. A deletion is a ``SessionDelete``
on ``loopwire.turns`` (header ``x-loopwire-kind: session.delete``), so that it is ordered with
the session's turns: its unfinished turns are cancelled first (each ends as ``cancelled``, with
its events and replies), and once none runs everything of the session is deleted — state,
history, results, queued requests, controls, the redaction mapping, the notes filed for it,
the tool-call idempotency records of its turns — and ``session.deleted`` is announced; a
``reply_to`` gets a ``SessionReply``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from contracts.base import AgentName, Contract, SafeId
from contracts.messages import ChatMessage
from contracts.state import Spend
from contracts.steps import StepExecution
from contracts.turns import FinishReason, TurnResult

QueryOp = Literal["get", "history", "turns", "result", "text", "turn", "steps"]
TurnStatus = Literal["queued", "running", "waiting", "done"]


class SessionQuery(Contract):
    """A read: ``get`` (the summary), ``history`` (a page of messages), ``turns`` (the turns
    with their status), ``result`` (a turn's result: ``turn_id``, ``session_id`` optional),
    ``text`` (the saved text of one step's answer: ``session_id``, ``turn_id``, ``step``; while
    the turn runs, and for its last step once it has ended), ``turn`` (one turn's status, in
    ``turns``: ``turn_id``, ``session_id`` optional; known once a worker has accepted it),
    ``steps`` (a page of the records of a turn's completed steps, oldest first: ``turn_id``,
    ``session_id`` optional; kept ``ttl_s`` past the turn's end)."""

    schema_version: Literal[1] = 1
    op: QueryOp
    session_id: SafeId | None = None
    turn_id: SafeId | None = None
    offset: int = Field(
        default=0,
        ge=0,
        description="Messages (from the chosen end) or, with op 'steps', step records to skip.",
    )
    limit: int = Field(default=100, ge=1, le=1000)
    newest_first: bool = Field(default=False, description="With op 'history': newest first.")
    step: int | None = Field(
        default=None,
        ge=0,
        description="With op 'text': the step.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )

    @model_validator(mode="after")
    def _names_what_it_reads(self) -> SessionQuery:
        if self.op in ("result", "text", "turn", "steps") and self.turn_id is None:
            raise ValueError(f"op {self.op!r} needs turn_id")
        if self.op == "text" and self.step is None:
            raise ValueError("op 'text' needs step")
        if self.op not in ("result", "turn", "steps") and self.session_id is None:
            raise ValueError(f"op {self.op!r} needs session_id")
        return self


class SessionDelete(Contract):
    schema_version: Literal[1] = 1
    session_id: SafeId
    reason: str = Field(default="deleted", min_length=1, max_length=120)
    by: str | None = Field(default=None, max_length=200, description="Who asked (for the log).")
    reply_to: str | None = Field(default=None, max_length=255, pattern=r"^[A-Za-z0-9_.:-]+$")


class SessionSummary(Contract):
    session_id: SafeId
    agent: AgentName = Field(description="The agent of the session's first turn.")
    turns: int = Field(description="Turns finished in the session (persisted ones).")
    history_len: int
    spent: Spend = Field(description="What the session's finished turns spent.")
    created_at: float
    updated_at: float
    running: SafeId | None = Field(default=None, description="The turn running or parked now.")
    parked: bool = Field(default=False, description="Whether that turn waits, holding no worker.")
    queued: int = Field(default=0, description="Turns waiting behind it.")


class TurnInfo(Contract):
    turn_id: SafeId
    status: TurnStatus
    finish_reason: FinishReason | None = None


class SessionReply(Contract):
    """The answer to a ``SessionQuery`` or a ``SessionDelete``: ``ok``, or ``error`` (with
    ``code``: ``not_found``, ``bad_request``)."""

    schema_version: Literal[1] = 1
    ok: bool
    code: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, max_length=2000)
    summary: SessionSummary | None = None
    messages: tuple[ChatMessage, ...] = ()
    total: int | None = Field(
        default=None,
        description="All pages: the messages in the history, or with op 'steps' the turn's "
        "step records.",
    )
    turns: tuple[TurnInfo, ...] = ()
    result: TurnResult | None = None
    deleted_keys: int | None = None
    text: str | None = Field(
        default=None,
        description="op 'text': the step's saved text.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    steps: tuple[StepExecution, ...] = Field(
        default=(),
        description="op 'steps': a page of the turn's completed steps, oldest first, each "
        "record as the turn's step list keeps it (StepExecution.stored: the messages and tool "
        "results the history holds are not repeated).",
        exclude_if=lambda value: not value,  # added to v1: written only when set
    )
