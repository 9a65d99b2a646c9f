"""Where a step leaves a turn: the closed union the loop returns (``RunAgain`` or
``Finished``), and the step waiting for the model between its two phases (``ModelCall``)."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass

from contracts.state import AgentState, ChildTurn, ModelResponse, TurnTrace
from contracts.turns import TurnRequest, TurnResult
from worker.loop.ports import Parked
from worker.loop.streaming import StepStream


@dataclass(frozen=True, slots=True)
class RunAgain:
    """The turn goes on: run the next step."""

    state: AgentState


@dataclass(frozen=True, slots=True)
class Finished:
    """The turn is over."""

    state: AgentState
    result: TurnResult
    orphans: tuple[ChildTurn, ...] = ()
    """Child turns the turn still waited on when it ended: they are cancelled."""
    trace: TurnTrace | None = None
    """The turn's span ids, when it is traced (its span is made once the turn has ended)."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """The turn is parked (``status: waiting``): nothing runs until a control message, or the
    wait's timeout at ``until``, resumes it."""

    state: AgentState
    until: float | None
    start: tuple[TurnRequest, ...] = ()
    """Child turns to start (again: a copy of one started is a duplicate, and runs nothing)."""


StepOutcome = RunAgain | Finished | Waiting


@dataclass(frozen=True, slots=True)
class ModelCall:
    """A step waiting for the model: the state parked by the store, the answer to come, and
    what the step records of the call."""

    parked: Parked
    answer: Awaitable[ModelResponse]
    model: str | None
    index: int
    input_count: int
    offered: tuple[str, ...]
    started: float
    called: float
    sent_tokens: int | None = None
    """With a context budget: the estimated tokens sent (unscaled: ``raw_tokens``)."""
    raw_tokens: int | None = None
    summarized: bool = False
    held: StepStream | None = None
    """A streamed answer held back (a hook may change it): its text goes out as one delta
    once ``after_model`` ran."""
    taken: frozenset[str] = frozenset()
    """The ids of the turn's earlier tool calls (``unique_call_ids``)."""


Phase = RunAgain | Finished | ModelCall | Waiting
"""Where the phase before the model call leaves a step: the tools are next (``RunAgain``), the
turn is over, or the model has been asked."""
