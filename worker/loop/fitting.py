"""The context budget applied to one step's messages (``worker.loop.context`` has the rules):
what is sent, the summary call when one is due (saved at once), and what the step records.
``Loop`` mixes it in (through ``worker.loop.composer``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contracts.messages import ChatMessage
from contracts.state import AgentState, ContextSummary
from worker.errors import ModelError
from worker.loop.context import (
    NO_CONTEXT_BUDGET,
    ContextBudget,
    cut_point,
    estimate,
    protected_from,
    summary_message,
    summary_request,
)
from worker.loop.gates import Gates
from worker.loop.ports import Model, ModelRequest, Price
from worker.loop.spec import AgentSpec
from worker.loop.transcript import StoredMessages, Transcript
from worker.loop.turn import turn_of, with_execution
from worker.runtime import failpoints

log = logging.getLogger("loopwire.loop")

MAX_FOLDS = 3
"""Summary calls one step makes at most (a new summary may leave too little room for what
follows it, which is then folded in as well)."""


@dataclass(frozen=True, slots=True)
class Fitted:
    """The messages to send, their estimate (scaled, and unscaled), and whether a summary is
    among them."""

    state: AgentState
    messages: Sequence[ChatMessage]
    tokens: int
    raw_tokens: int
    summarized: bool


class Fitting(Gates):
    """Mixed into ``Loop``: what it has that this uses."""

    __slots__ = ()

    model: Model
    price: Price

    async def _fit(
        self, state: AgentState, agent: AgentSpec, messages: Sequence[ChatMessage]
    ) -> Fitted:
        ex = turn_of(state)
        budget = agent.context
        if budget.max_tokens is None:
            budget = NO_CONTEXT_BUDGET.model_copy(update={"max_tokens": 1 << 40})
        system, stored = _split(messages)
        raw = stored.raw
        ratio = state.token_ratio or 1.0
        prompt = estimate(_dump(system)) if system is not None else 0
        limit = budget.max_tokens or 0
        if ex.context_forced:  # the model refused the last request as too long: half of it
            limit = min(limit, int((prompt + sum(estimate(m) for m in raw)) * ratio) // 2)
        keep = protected_from(raw, ex.history_start, budget.keep_last)
        summary = state.summary if budget.strategy == "summarize" else None
        base = summary.upto if summary is not None and summary.upto <= keep else 0
        if not base:
            summary = None

        def cut_behind(summary: ContextSummary | None, base: int) -> int:
            """Where the sent conversation starts behind ``summary`` (covering ``raw[:base]``)."""
            fixed = prompt + _size(summary)
            return base + cut_point(raw[base:], fixed, limit, keep - base, ratio).start

        start = cut_behind(summary, base)
        folds = 0
        makes = budget.strategy == "summarize" and ex.request.persist  # else it makes none
        while makes and start > base and folds < MAX_FOLDS:
            # what is cut goes into the summary; the new summary takes room too, so what
            # follows it may have to go in as well
            made = await self._summarize(state, agent, budget, summary, raw, base, start)
            folds += 1
            if made is None:
                break
            state, summary, base = made, made.summary, start
            start = cut_behind(summary, base)
        # the summary goes with what follows it; a persist: false turn sends the session's
        # before what its cut leaves, else a summary that does not reach the cut is not sent
        shown = summary if base and (base == start or not ex.request.persist) else None
        sent: list[ChatMessage] | Transcript
        if shown is not None:
            sent = [*([system] if system else []), summary_message(shown.text)]
            sent += list(StoredMessages(list(raw[start:])))
        else:
            sent = Transcript(system, stored.tail(start))
        unscaled = prompt + _size(shown) + sum(estimate(m) for m in raw[start:])
        return Fitted(state, sent, round(unscaled * ratio), unscaled, shown is not None)

    async def _summarize(
        self,
        state: AgentState,
        agent: AgentSpec,
        budget: ContextBudget,
        previous: ContextSummary | None,
        raw: Sequence[dict[str, Any]],
        base: int,
        start: int,
    ) -> AgentState | None:
        """One model call folding ``raw[base:start]`` into the summary, saved at once (so it is
        made once); ``None`` when the call failed (the step sends the window instead)."""
        ex = turn_of(state)
        dropped = list(StoredMessages(list(raw[base:start])))
        request = ModelRequest(
            messages=[
                ChatMessage(role="system", content=budget.summary_prompt),
                *summary_request(previous.text if previous else None, dropped),
            ],
            model=budget.summary_model or agent.model,
            provider=agent.provider,
        )
        try:
            response = await self.model.complete(request)
        except ModelError as exc:
            log.warning("summary of session %s failed, sending a window: %s", state.session_id, exc)
            return None
        text = response.message.content or ""
        summarized = ContextSummary(text=text[:100_000], upto=start, made_at=self.clock())
        state = state.model_copy(update={"summary": summarized})
        state = with_execution(
            state,
            usage=ex.usage + response.usage,
            cost_usd=ex.cost_usd + self.price(request.model, response.usage),
        )
        saved = await self._save(state)
        failpoints.hit("summary_saved")
        return saved


def _split(messages: Sequence[ChatMessage]) -> tuple[ChatMessage | None, StoredMessages]:
    """The system prompt and the conversation as stored data (as the store handed it over,
    with what the worker has encoded of it, when it is)."""
    if isinstance(messages, Transcript) and isinstance(messages.history, StoredMessages):
        return messages.system, messages.history
    listed = list(messages)
    system = listed[0] if listed and listed[0].role == "system" else None
    rest = listed[1:] if system is not None else listed
    return system, StoredMessages([_dump(m) for m in rest])


def _size(summary: ContextSummary | None) -> int:
    """The (unscaled) tokens of the message that sends ``summary``."""
    return estimate(_dump(summary_message(summary.text))) if summary is not None else 0


def _dump(message: ChatMessage) -> dict[str, Any]:
    return message.model_dump(mode="json", exclude_none=True)
