"""Following a streamed turn from its events (``TurnHandle.stream()``).

A turn that streams publishes its answers' text as ``message.delta`` events (``seq`` from 0
per step). ``follow_text`` turns a turn's events into the text a reader should see: each
delta in ``seq`` order as it arrives; a delta that says ``restarted`` starts its step over
(the ``StreamText`` says so too, so a display can drop what it showed of that step); a step
whose deltas were missed (a gap in ``seq``, or the subscription began after its first delta)
shows nothing more until its ``step.completed``, and then what the reader had not seen of the
step's saved text (``SessionQuery`` op ``text``), or the whole text, ``restarted``, when what
it saw is not where that text begins. A step whose saved text cannot be read any more (the
turn ended and moved on) is left as it was: the turn's result still has the final answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from contracts.events import Event, MessageDelta

ReadText = Callable[[int], Awaitable[str | None]]
"""The saved text of a step of the turn (None: not saved)."""


@dataclass(frozen=True, slots=True)
class StreamText:
    """Text of a step's answer as it arrives; ``restarted``: the step's text starts over here."""

    step: int
    text: str
    restarted: bool = False


@dataclass(slots=True)
class _Step:
    next_seq: int = 0
    seen: list[str] = field(default_factory=list)
    missed: bool = False


async def follow_text(
    events: AsyncIterator[Event], read_text: ReadText
) -> AsyncIterator[StreamText]:
    """The text of the turn's answers, from its events (which end with the turn's end)."""
    steps: dict[int, _Step] = {}
    async for event in events:
        data, step = event.data, event.step
        if step is None:
            continue
        if isinstance(data, MessageDelta):
            piece = _take(steps, step, data)
            if piece is not None:
                yield piece
        elif event.type == "step.completed" and step in steps and steps[step].missed:
            piece = await _fill(steps[step], step, read_text)
            if piece is not None:
                yield piece


def _take(steps: dict[int, _Step], step: int, delta: MessageDelta) -> StreamText | None:
    known = steps.get(step)
    if delta.restarted:
        steps[step] = _Step(next_seq=delta.seq + 1, seen=[delta.text])
        return StreamText(step, delta.text, restarted=True)
    if known is None:
        known = steps[step] = _Step()
    if known.missed:
        return None
    if delta.seq != known.next_seq:
        known.missed = True
        return None
    known.next_seq += 1
    known.seen.append(delta.text)
    return StreamText(step, delta.text)


async def _fill(known: _Step, step: int, read_text: ReadText) -> StreamText | None:
    saved = await read_text(step)
    if saved is None:
        return None
    known.missed = False
    seen = "".join(known.seen)
    known.seen = [saved]
    if saved.startswith(seen):
        return StreamText(step, saved[len(seen) :]) if len(saved) > len(seen) else None
    return StreamText(step, saved, restarted=True)
