"""One leased step's hold on a session in Redis (``SessionHandle``, the loop's ``StateStore``):
the state read with the lease, the state parked as its stored bytes while the model thinks,
and the save script that fences every write. ``RedisStore`` (``worker.session.store``) hands
them out; a handle knows of it only what ``HandleStore`` says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from contracts import keys
from contracts.codec import decode, encode, encode_stored, read_stored
from contracts.control import TurnCancel, TurnChildResult, TurnDecision
from contracts.messages import ChatMessage
from contracts.state import AgentState, StepExecution
from contracts.tools import idempotency_key
from contracts.turns import TurnResult
from worker.errors import StaleStateError
from worker.loop.transcript import StoredMessages
from worker.runtime import failpoints
from worker.session.blobs import _bytes, _unpack
from worker.session.history_cache import HistoryRead
from worker.session.port import Opening, SessionStore, list_waiting
from worker.session.port import lifetime as session_lifetime


class HandleStore(SessionStore, Protocol):
    """What a handle uses of the store that hands it out (``RedisStore``)."""

    redis: Redis
    ttl_s: int
    cluster: bool
    clock: Callable[[], float]
    _save: AsyncScript

    def timed(self, operation: str) -> AbstractContextManager[object]: ...

    def encode_state(self, state: AgentState) -> bytes: ...

    async def beside(
        self,
        script: AsyncScript,
        script_keys: list[str],
        args: list[Any],
        other: Callable[[Any], Any],
    ) -> Any: ...


class ParkedState:
    """A state held as the bytes it is stored as, with its version (kept beside them)."""

    __slots__ = ("blob", "version")

    def __init__(self, blob: bytes, version: int) -> None:
        self.blob = blob
        self.version = version

    def unpark(self) -> AgentState:
        state = read_stored(self.blob, AgentState)
        if state.version != self.version:
            state = state.model_copy(update={"version": self.version})
        return state


class SessionHandle:
    """``StepSession`` of the Redis store: one step under one lease.

    While the model thinks (seconds, with thousands of turns in flight) a state is held as the
    bytes it is stored as (``park``): the objects of a state take much more memory than its
    stored bytes and grow with every step. The handle remembers the bytes it last read or
    wrote, with their version, where the loop asks the model next (no step pending), so that
    parking that state does not encode it again; the session history read with the lease is
    handed out once (``HistoryRead``: with the worker's copy of it) and kept current with what
    the step appends (no other writer appends while the lease is held)."""

    __slots__ = (
        "_handed",
        "_history",
        "_state",
        "_stored",
        "cancel",
        "children",
        "controls_waiting",
        "decisions",
        "next_turn",
        "opening",
        "parked",
        "released",
        "replies",
        "session_id",
        "store",
        "token",
        "turn_id",
    )

    def __init__(
        self,
        store: HandleStore,
        session_id: str,
        token: int,
        state: AgentState | None,
        stored: tuple[int, bytes] | None,
        history: HistoryRead | None,
    ) -> None:
        self.store = store
        self.session_id = session_id
        self.token = token
        self._state = state
        self._stored = stored if state is not None and _asks_model(state) else None
        self._history = history
        self._handed = False
        self.next_turn: str | None = None
        self.replies: tuple[str, ...] = ()
        self.released = False
        self.turn_id = ""
        self.cancel: TurnCancel | None = None
        self.decisions: dict[str, TurnDecision] = {}
        self.children: dict[str, TurnChildResult] = {}
        self.parked: int | None = None
        self.controls_waiting = False
        self.opening: Opening | None = None

    def read_controls(self, flat: Sequence[bytes | str]) -> None:
        """The turn's controls hash as the lease script read it (field, value, …)."""
        for field, value in zip(flat[::2], flat[1::2], strict=True):
            name = _bytes(field).decode()
            if name == "cancel":
                self.cancel = decode(_bytes(value), TurnCancel)
            elif name == "parked":
                self.parked = int(_bytes(value))
            elif name.startswith("decision:"):
                self.decisions[name[9:]] = decode(_bytes(value), TurnDecision)
            elif name.startswith("child:"):
                self.children[name[6:]] = decode(_bytes(value), TurnChildResult)

    def take_state(self) -> AgentState | None:
        state, self._state = self._state, None
        return state

    def cancelled(self) -> bool:
        return self.cancel is not None

    def park(self, state: AgentState) -> ParkedState:
        stored, self._stored = self._stored, None
        if stored is not None and stored[0] == state.version:
            return ParkedState(stored[1], state.version)
        return ParkedState(encode_stored(state), state.version)

    async def list_waiting(self, state: AgentState) -> None:
        await list_waiting(self.store, state)

    async def load_messages(self, state: AgentState) -> StoredMessages:
        redis = self.store.redis
        sid = state.session_id
        ex = state.execution
        if self._history is not None and not self._handed and (ex is None or ex.request.persist):
            self._handed = True
            messages = self._history.messages()
            if messages is not None:
                return messages
        with self.store.timed("load_messages"):
            if ex is None or ex.request.persist:
                items = await redis.lrange(keys.session_history(sid), 0, -1)
            else:
                async with redis.pipeline(transaction=False) as pipe:
                    pipe.lrange(keys.session_history(sid), 0, ex.history_start - 1)
                    pipe.lrange(keys.turn_transient(sid, ex.turn_id), 0, -1)
                    before, during = await pipe.execute()
                items = [*before, *during] if ex.history_start > 0 else list(during)
        return StoredMessages(_unpack(items))

    async def load_steps(self, state: AgentState) -> list[StepExecution]:
        ex = state.execution
        if ex is None:
            return []
        with self.store.timed("load_steps"):
            items = await self.store.redis.lrange(
                keys.turn_steps(state.session_id, ex.turn_id), 0, -1
            )
        return [*ex.steps, *(read_stored(_bytes(item), StepExecution) for item in items)]

    async def save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        result: TurnResult | None = None,
        release: bool = False,
        step: StepExecution | None = None,
        cut_to: int | None = None,
    ) -> AgentState:
        sid = state.session_id
        ex = state.execution
        release = release or result is not None
        turn_id = result.turn_id if result else (ex.turn_id if ex else "")
        # a finished turn's state has no execution: its messages went where the turn said
        transient = ex is not None and not ex.request.persist
        target = keys.turn_transient(sid, turn_id) if transient else keys.session_history(sid)
        appended = [encode(m) for m in append]
        blob = self.store.encode_state(state)
        parked = _parked_arg(state, self.parked)
        lifetime = session_lifetime(state, self.store.ttl_s, self.store.clock())
        args: list[Any] = [
            self.token,
            state.version,
            blob,
            "1" if release else "0",
            lifetime,
            encode(result) if result is not None else "",
            turn_id,
            parked,
            encode(step.stored()) if step is not None else "",
            len(appended),
            *appended,
            *_counted(call_keys(state)),
            "" if cut_to is None else cut_to,
        ]
        result_key = keys.turn_result(sid, turn_id) if result else keys.turn_result(sid, "_")
        try:
            with self.store.timed("save"):
                # every save of a turn gives its session index the expiry it gives the
                # session's keys: the turn keeps its id as long as it lives
                version, head, replies, waiting, cancel, generation = await self._write(
                    [
                        keys.session_lease(sid),
                        keys.session_state(sid),
                        target,
                        result_key,
                        keys.session_turns(sid),
                        keys.session_queue(sid),
                        keys.session_requests(sid),
                        keys.turn_transient(sid, turn_id or "_"),
                        keys.session_replies(sid),
                        keys.turn_controls(sid, turn_id or "_"),
                        keys.session_fence(sid),
                        keys.session_history(sid),
                        keys.session_calls(sid),
                        keys.session_children(sid),
                        keys.turn_steps(sid, turn_id or "_"),
                    ],
                    args,
                    (keys.turn_session(turn_id), lifetime) if turn_id else None,
                )
        except BaseException as exc:
            if self._history is not None:
                self._history.lost()
            if isinstance(exc, ResponseError) and "STALE" in str(exc):
                raise StaleStateError(f"session {sid}: {exc}") from None
            raise
        if self._history is not None:
            self._history.saved(
                _bytes(generation).decode(),
                () if transient else appended,
                cut=cut_to is not None,
            )
        self.released = release
        if cancel and self.cancel is None:  # recorded while the step ran
            self.cancel = decode(_bytes(cancel), TurnCancel)
        if parked == "-":
            self.parked = None
        elif parked:
            self.parked = int(parked)
            self.controls_waiting = bool(int(waiting))
        if step is not None:
            failpoints.hit("step_recorded")
        _failpoint_after_save(state, append)
        if parked:
            failpoints.hit("parked" if parked != "-" else "resumed")
        if result is not None:
            head = head.decode() if isinstance(head, bytes) else head
            self.next_turn = head or None
            self.replies = tuple(_bytes(replies).decode().split())
        saved = state.model_copy(update={"version": int(version)})
        # kept for the model call that follows a turn's first save; after any other save the
        # step waits on tools or is over, and the bytes would only be held longer
        keep = not release and _asks_model(saved)
        self._stored = (saved.version, blob) if keep else None
        return saved

    async def _write(
        self, script_keys: list[str], args: list[Any], index: tuple[str, int] | None
    ) -> Any:
        """The save script's reply; with ``index`` (the turn's session index and the lifetime
        the save gives the session's keys), the index is given twice that: by the script itself
        on one Redis (one script takes keys of any slot there), beside it in the same round
        trip on a cluster. So the index outlives every key of its turn."""
        if index is None:
            return await self.store._save(keys=script_keys, args=args)
        key, ttl = index
        if not self.store.cluster:
            return await self.store._save(keys=[*script_keys, key], args=args)
        # on a cluster the index is never shortened (GT): the command runs even when the save
        # is refused as stale
        return await self.store.beside(
            self.store._save, script_keys, args, lambda r: r.expire(key, 2 * ttl, gt=True)
        )


def _counted(items: Sequence[str]) -> list[str | int]:
    """A script's variable-length argument: its length, then its items."""
    return [len(items), *items]


def call_keys(state: AgentState) -> list[str]:
    """The idempotency keys of the tool calls the step's model answer asked for (none before
    it answered): the session records them, so that erasing it finds the tool services'
    records of them by name."""
    ex = state.execution
    if ex is None or ex.pending is None or ex.pending.response is None:
        return []
    return [idempotency_key(ex.turn_id, c.id) for c in ex.pending.response.message.tool_calls]


def _parked_arg(state: AgentState, parked: int | None) -> str:
    """The save script's ``parked``: the step a turn parks at, '-' when a parked turn goes on
    (or ends), '' otherwise."""
    ex = state.execution
    if ex is not None and ex.status == "waiting":
        index = ex.pending.index if ex.pending is not None else ex.step_count
        return "" if parked == index else str(index)
    return "-" if parked is not None else ""


def _asks_model(state: AgentState) -> bool:
    ex = state.execution
    return ex is not None and ex.pending is None


def _failpoint_after_save(state: AgentState, append: Sequence[ChatMessage]) -> None:
    if any(m.role == "assistant" and m.tool_calls for m in append):
        failpoints.hit("model_saved")
    ex = state.execution
    if any(m.role == "tool" for m in append) or (
        not append and ex is not None and ex.pending is not None and ex.pending.results
    ):
        failpoints.hit("tool_result_saved")
