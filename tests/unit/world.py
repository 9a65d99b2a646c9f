"""A world for tests of the sequencer without a transport: a driver plays the transport (it
performs every action the sequencer returns, as the consumer would) over a ``MemoryStore``,
and the model answers by the agent that asks (its system prompt is ``agent:<name>``)."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contracts.base import Contract
from contracts.control import TurnCancel, TurnChildResult
from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.sessions import SessionDelete
from contracts.state import ModelResponse
from contracts.tools import ToolDefinition
from contracts.turns import InputMessage, TurnRequest, TurnResult
from worker.loop import Hook
from worker.loop.ports import ModelRequest
from worker.profiles.agents import AgentProfiles
from worker.runtime.tracing import Tracing
from worker.sequencing.actions import Action, Busy, Control, Delay, Drop, Reply, Start, Step
from worker.sequencing.actions import Answer as SessionAnswer
from worker.sequencing.sequencer import SessionSequencer
from worker.testing.memory import FunctionTools, ListSink, MemoryStore, ToolFunction
from worker.testing.sequencing import sequencer_over

Answer = Callable[[ModelRequest], ModelResponse]


def says(text: str, tokens: int = 10) -> ModelResponse:
    usage = Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
    return ModelResponse(message=ChatMessage(role="assistant", content=text), usage=usage)


def calls(*pairs: tuple[str, str], tokens: int = 10) -> ModelResponse:
    tool_calls = tuple(
        ToolCall(id=f"call_{i}", name=name, arguments=json.dumps({"input": text}))
        for i, (name, text) in enumerate(pairs)
    )
    usage = Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
    return ModelResponse(
        message=ChatMessage(role="assistant", tool_calls=tool_calls),
        finish_reason="tool_calls",
        usage=usage,
    )


def last_user(request: ModelRequest) -> str:
    return next(m.content or "" for m in reversed(request.messages) if m.role == "user")


def tool_results(request: ModelRequest) -> list[str]:
    return [m.content or "" for m in request.messages if m.role == "tool"]


class ByAgent:
    """A model that answers by the agent asking (its system prompt names it: ``agent:<name>``)."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers
        self.requests: list[tuple[str, ModelRequest]] = []

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        system = request.messages[0].content or ""
        agent = system.removeprefix("agent:")
        self.requests.append((agent, request))
        return self._answer(self.answers[agent], request)

    @staticmethod
    async def _answer(answer: Answer, request: ModelRequest) -> ModelResponse:
        response = answer(request)  # raises in the awaitable, as a real model's error does
        stream = request.stream
        if stream is not None:  # streamed as a model would: the text in pieces, then the end
            stream.begin()
            text = response.message.content or ""
            for i in range(0, len(text), 3):
                await stream.text(text[i : i + 3])
            await stream.end()
        return response

    def asked(self, agent: str) -> list[ModelRequest]:
        return [r for a, r in self.requests if a == agent]


@dataclass
class World:
    sequencer: SessionSequencer
    store: MemoryStore
    model: ByAgent
    events: ListSink
    replies: list[TurnResult] = field(default_factory=list)
    delayed: list[Action] = field(default_factory=list)
    published: list[Action] = field(default_factory=list)
    answered: list[SessionAnswer] = field(default_factory=list)

    async def run(self, request: TurnRequest, *, until_idle: bool = True) -> None:
        await self.drive([Start(request)])

    async def drive(self, actions: list[Action], limit: int = 500) -> None:
        """Perform actions as the transport would, until none is left."""
        todo: deque[Action] = deque(actions)
        while todo and limit:
            limit -= 1
            action = todo.popleft()
            self.published.append(action)
            if isinstance(action, Reply):
                self.replies.append(action.result)
                continue
            if isinstance(action, Delay):
                self.delayed.append(action)
                continue
            if isinstance(action, Drop):
                continue
            if isinstance(action, SessionAnswer):
                self.answered.append(action)
                continue
            more = await self.handle(action)
            if any(isinstance(a, Busy) for a in more):
                todo.append(action)
            todo.extend(a for a in more if not isinstance(a, Busy))
        assert limit, "the turns did not settle"

    async def handle(self, action: Action) -> list[Action]:
        if isinstance(action, Step):
            return await self.sequencer.on_step(action.work)
        if isinstance(action, Start):
            return await self.sequencer.on_request(action.request)
        assert isinstance(action, Control)
        message: Contract = action.message
        if isinstance(message, TurnChildResult):
            return await self.sequencer.on_child_result(message)
        if isinstance(message, SessionDelete):
            return await self.sequencer.on_session_delete(message)
        assert isinstance(message, TurnCancel)
        return await self.sequencer.on_cancel(message)

    def result(self, turn_id: str) -> TurnResult:
        found = [r for r in self.replies if r.turn_id == turn_id]
        assert found, f"no result for {turn_id}"
        return found[-1]

    def starts(self) -> list[TurnRequest]:
        return [a.request for a in self.published if isinstance(a, Start) and a.request.parent]

    async def child_result(self, parent: str, call_id: str) -> TurnResult:
        for request in self.starts():
            assert request.parent is not None
            if request.parent.turn_id == parent and request.parent.call_id == call_id:
                result = await self.store.result(request.session_id, request.turn_id)
                assert result is not None
                return result
        raise AssertionError(f"no child of {parent} for {call_id}")


def world(
    profiles: dict[str, Any],
    answers: dict[str, Answer],
    hooks: Hook | None = None,
    *,
    tools: Mapping[str, ToolFunction] | None = None,
    store: MemoryStore | None = None,
    announced: frozenset[str] | None = None,
    tracing: Tracing | None = None,
    daily: bool = False,
    clock: Callable[[], float] = time.time,
) -> World:
    """``tools``: functions the agents may call, each offered as a tool taking any arguments;
    ``store``: an earlier world's (its sessions go on); ``daily``: the store keeps the agents'
    daily spend (daily budgets are checked); ``clock``: the workers' time."""
    for agent in profiles.get("agents", []):
        agent.setdefault("system_prompt", f"agent:{agent['name']}")
    loaded = AgentProfiles.model_validate(profiles)
    store, model, events = store or MemoryStore(), ByAgent(answers), ListSink()
    sequencer = sequencer_over(
        store,
        model=model,
        tools=FunctionTools(dict(tools or {})),
        definitions=[ToolDefinition(name=name) for name in tools or {}],
        events=events,
        agents=loaded.agents,
        hooks=hooks,
        announced=announced,
        tracing=tracing,
        ledger=store if daily else None,
        clock=clock,
    )
    return World(sequencer, store, model, events)


def request(agent: str, text: str, turn_id: str = "T1", **changes: Any) -> TurnRequest:
    return TurnRequest(
        turn_id=turn_id,
        session_id="S1",
        agent=agent,
        input=(InputMessage(content=text),),
        reply_to="client.replies",
        **changes,
    )
