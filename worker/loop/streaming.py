"""Token streaming: a step's text as ``message.delta`` events while the model writes it.

A profile (``stream: true``) or a turn request (``stream``) asks for it; an operator who
turned ``message.delta`` off in ``LOOPWIRE_EVENTS`` turns streaming off with it (the model is
then called as without). The model adapter reads the model's server-sent events, assembles
the tool calls itself (they are never published) and hands each piece of text to the step's
``StepStream``, which coalesces them: the first piece goes out at once (the reader sees the
answer begin), then at most one publish per ``interval_s`` unless ``max_chars`` have piled
up, and what is left when the answer is complete. A step makes a handful of publishes, not
one per token; no timer runs, so a pause in the model's output holds its last piece until the
next one or the end.

An agent whose hooks may change the answer in ``after_model`` (``content_guard``;
``worker.loop.hooks.rewrites_answer``) is not streamed live: its model is called without a
stream, and the answer's text as the hooks left it goes out as one delta once they ran (the
step's held ``StepStream``, published after the answer is saved), so a stream never shows what
a guard withholds.

The answer is saved exactly as without streaming. A step that is redone re-streams: when the
model's answer was saved, its text goes out again as one delta; when it was not, the model is
asked again. Either way the first delta of the redone step says ``restarted`` (so does the
first delta after the adapter asks the model again within one step, e.g. after a malformed
stream): a subscriber drops what it had of the step. One that missed deltas (a gap in
``seq``, or it joined late) reads the step's saved text (``SessionQuery`` op ``text``).

Each delta's event id carries a nonce of the stream as well as its ``seq``: a redone step's
deltas are other occurrences than the first attempt's, not duplicates of them.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from contracts.events import MessageDelta

Publish = Callable[[MessageDelta, str], Awaitable[None]]
"""Publishes a delta with the id suffix that makes its event id."""


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """How deltas are coalesced (``LOOPWIRE_STREAM_INTERVAL_S``, ``LOOPWIRE_STREAM_MAX_CHARS``)."""

    interval_s: float = 0.05
    max_chars: int = 400


DEFAULT_STREAM = StreamSettings()


class StepStream:
    """The text stream of one model call of one step (``worker.loop.ports.TextStream``)."""

    __slots__ = (
        "_buffer",
        "_clock",
        "_last",
        "_nonce",
        "_publish",
        "_restart",
        "_sent",
        "_seq",
        "_settings",
        "_size",
    )

    def __init__(
        self,
        publish: Publish,
        settings: StreamSettings,
        *,
        restarted: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._publish = publish
        self._settings = settings
        self._clock = clock
        self._buffer: list[str] = []
        self._size = 0
        self._seq = 0
        self._last = -math.inf
        self._restart = restarted
        self._sent = False
        self._nonce = os.urandom(4).hex()

    @property
    def published(self) -> int:
        """Deltas published so far."""
        return self._seq

    def begin(self) -> None:
        """The model is asked (again): text from an earlier attempt is dropped, and when any of
        it went out, the next delta says ``restarted``."""
        if self._sent:
            self._restart = True
        self._buffer.clear()
        self._size = 0

    async def text(self, piece: str) -> None:
        """A piece of the answer's text as it arrives."""
        if not piece:
            return
        self._buffer.append(piece)
        self._size += len(piece)
        now = self._clock()
        if self._size >= self._settings.max_chars or now - self._last >= self._settings.interval_s:
            await self._flush(now)

    async def end(self) -> None:
        """The answer is complete: what is left goes out."""
        if self._size:
            await self._flush(self._clock())

    async def replay(self, text: str) -> None:
        """A redone step whose answer was saved: its whole text, as one delta."""
        if text:
            self._buffer = [text]
            self._size = len(text)
            await self._flush(self._clock())

    async def _flush(self, now: float) -> None:
        text = "".join(self._buffer)
        self._buffer.clear()
        self._size = 0
        delta = MessageDelta(seq=self._seq, text=text, restarted=self._restart)
        self._seq += 1
        self._restart = False
        self._sent = True
        self._last = now
        await self._publish(delta, f"{self._nonce}:{delta.seq}")
