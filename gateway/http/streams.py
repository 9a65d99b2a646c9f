"""A run's stream of server-sent events, resumable: every event's id says where the client
is, so a client that reconnects with ``Last-Event-ID`` (to any replica) gets what it missed
and then the live rest, with no gap and nothing twice.

An id is ``<step>.<offset>.<known>``: the step whose answer's text the client has up to
``offset`` characters, and ``known``, the thread's messages the client has been told of (by
``updates`` or ``values``); ``end`` after the run's end. The events:

- ``metadata`` (``run_id``, ``thread_id``) first, on a new stream (not on a rejoin);
- ``messages`` (``messages-tuple``): ``[chunk, metadata]``, each chunk an ``AIMessageChunk``
  with text of the step's answer, in order: the ``message.delta`` events as they come, and
  where some were missed (a gap in their ``seq``, or a rejoin), the rest of the step's saved
  text once it is saved (``SessionQuery`` op ``text``);
- after a step: ``updates`` (the thread's messages past ``known``, under the node ``agent``)
  and ``values`` (all of them), each only when there are new messages;
- at the end: ``values`` (if new), ``error`` for a run that failed, ``end`` (``status``).

A rejoin subscribes to the run's events first, then reads what is saved: the rest of the
client's step's text and of each later step's (while the run runs), the messages past
``known``, and the run's result if it has ended; then it follows the live events, dropping
what the saved state already covered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from contracts.client import LoopwireClient
from contracts.events import Event, MessageDelta
from contracts.turns import TurnResult
from gateway.http import approvals, shapes
from gateway.http.runs import FINAL_EVENTS, whole_history

Sent = tuple[str, Any, str]
"""One event: its name, its data, its id."""


@dataclass(frozen=True, slots=True)
class Cursor:
    step: int = 0
    offset: int = 0
    known: int = 0
    ended: bool = False

    def __str__(self) -> str:
        return "end" if self.ended else f"{self.step}.{self.offset}.{self.known}"

    @classmethod
    def parse(cls, text: str | None) -> Cursor | None:
        if not text:
            return None
        if text == "end":
            return cls(ended=True)
        try:
            step, offset, known = (int(part) for part in text.split("."))
        except ValueError:
            return None
        return cls(step, offset, known) if min(step, offset, known) >= 0 else None


@dataclass(slots=True)
class _Text:
    offset: int = 0
    next_seq: int = 0
    missed: bool = False
    done: bool = False


@dataclass(slots=True)
class RunStream:
    client: LoopwireClient
    thread_id: str
    run_id: str
    modes: frozenset[str]
    redis: Redis
    known: int = 0
    interrupted: bool = False
    step: int = 0
    texts: dict[int, _Text] = field(default_factory=dict)

    @property
    def chunks(self) -> bool:
        return bool(self.modes & {"messages-tuple", "messages"})

    def _id(self) -> str:
        return str(Cursor(self.step, self._text(self.step).offset, self.known))

    def _text(self, step: int) -> _Text:
        return self.texts.setdefault(step, _Text())

    def _chunk(self, step: int, text: str) -> Sent:
        state = self._text(step)
        state.offset += len(text)
        self.step = step
        chunk = {"type": "AIMessageChunk", "content": text, "id": f"{self.run_id}:{step}"}
        meta = {"langgraph_node": shapes.GRAPH_NODE, "langgraph_step": step, "run_id": self.run_id}
        return "messages", [chunk, meta], self._id()

    async def _saved_rest(self, step: int) -> list[Sent]:
        """The rest of the step's saved text the client has not had (None saved: nothing)."""
        state = self._text(step)
        saved = await self.client.sessions.text(self.thread_id, self.run_id, step)
        if saved is None:
            return []
        state.missed, state.done = False, True
        rest = saved[state.offset :]
        return [self._chunk(step, rest)] if rest and self.chunks else []

    async def _new_messages(self) -> list[Sent]:
        history = await whole_history(self.redis, self.thread_id)
        if len(history) <= self.known:
            return []
        new = shapes.values(history[self.known :], self.thread_id, self.known)
        self.known = len(history)
        sent: list[Sent] = []
        if "updates" in self.modes:
            sent.append(("updates", {shapes.GRAPH_NODE: new}, self._id()))
        if "values" in self.modes:
            sent.append(("values", shapes.values(history, self.thread_id), self._id()))
        return sent

    async def on_event(self, event: Event) -> list[Sent]:
        step = event.step
        if isinstance(event.data, MessageDelta) and step is not None and self.chunks:
            state = self._text(step)
            delta = event.data
            if state.done or state.missed:
                return []
            if delta.seq != state.next_seq or (delta.restarted and delta.seq):
                state.missed = True  # the rest comes from the saved text, once saved
                return []
            state.next_seq += 1
            return [self._chunk(step, delta.text)]
        if event.type == "approval.requested":
            return await self.interrupt()
        if event.type == "step.completed" and step is not None:
            self.step = max(self.step, step)
            sent = await self._saved_rest(step) if self._text(step).missed else []
            self._text(step).done = True
            return sent + await self._new_messages()
        return []

    async def interrupt(self) -> list[Sent]:
        """The run waits for decisions: the thread's new messages, what waits (as the
        protocol's interrupts), and the stream's end; the run goes on once decided (a run
        created with ``command.resume``)."""
        calls = await approvals.waiting(self.redis, self.run_id)
        if not calls:
            return []
        self.interrupted = True
        sent = await self._new_messages()
        waiting = {"__interrupt__": approvals.interrupts(calls)}
        if "updates" in self.modes:
            sent.append(("updates", waiting, self._id()))
        if "values" in self.modes:
            history = await whole_history(self.redis, self.thread_id)
            sent.append(
                ("values", {**shapes.values(history, self.thread_id), **waiting}, self._id())
            )
        end = {"run_id": self.run_id, "status": "interrupted"}
        return [*sent, ("end", end, self._id())]

    async def catch_up(self, cursor: Cursor) -> list[Sent]:
        """A rejoin's missed events, from what is saved."""
        self.step, self.known = cursor.step, cursor.known
        self._text(cursor.step).offset = cursor.offset
        # the client's step: its deltas' offsets are not known, so its rest comes from its saved
        # text; each later step whose text is saved was done while the client was away
        self._text(cursor.step).missed = True
        sent: list[Sent] = []
        step = cursor.step  # steps count from 0
        while True:
            rest = await self._saved_rest(step)
            if not self._text(step).done:
                break
            sent += rest
            step += 1
        return sent + await self._new_messages()

    async def ending(self, result: TurnResult) -> list[Sent]:
        sent = []
        last = result.steps - 1  # steps count from 0; the last one's text stays saved
        if self.chunks and last >= 0 and not self._text(last).done:
            sent += await self._saved_rest(last)
        sent += await self._new_messages()
        if result.finish_reason == "error" and result.error is not None:
            error = {"error": result.error.code, "message": result.error.message}
            sent.append(("error", error, self._id()))
        status = shapes.run_status(None, result)
        return [*sent, ("end", {"run_id": self.run_id, "status": status}, "end")]


async def follow(
    stream: RunStream,
    events: AsyncIterator[Event],
    result: Callable[[], Awaitable[TurnResult | None]],
) -> AsyncIterator[Sent]:
    """The live rest of a run: its events until its end, then its ending."""
    async for event in events:
        for sent in await stream.on_event(event):
            yield sent
        if stream.interrupted:
            return
        if event.type in FINAL_EVENTS:
            break
    ended = await result()
    if ended is not None:
        for sent in await stream.ending(ended):
            yield sent
