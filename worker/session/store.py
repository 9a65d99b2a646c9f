"""Agent state in Redis: compare-and-set saves fenced by the session lease.

Layout (keys from ``contracts.keys``, all under the session's hash tag):

- ``state``: hash ``{v: version, s: AgentState}``, JSON without the fields at their defaults
  (``encode_stored``); msgpack, as earlier versions wrote it, is read too, and written with
  ``state_format="msgpack"`` while workers of those versions still run;
- ``history``: list of msgpack messages (appended to; a cancel with rollback cuts it back), ``turn:<id>:messages``
  the same for a ``persist: false`` turn;
- ``lease`` / ``fence``: the fencing token of the worker running a step, and
  the counter that hands out tokens (strictly increasing; erasing the session keeps it);
- ``queue``, ``turns``, ``requests``: the session's turns in arrival order, the
  status of every turn it accepted, the requests of turns not yet started;
- ``turn:<id>:result``: the stored ``TurnResult``.

While a session is erased (``worker.session.records``: its ``erasing`` mark holds the token of
its lease) an accept writes nothing and answers ``erasing``: the request comes back later.

Every key of a session expires; ``ttl_s`` is the session's idle lifetime. Accepting a turn,
taking or renewing the lease, recording a control message and every save keep each key of the
session they name (state, history, fence, queue, turns, requests, replies, the turn's controls
and ``persist: false`` messages) alive at least ``ttl_s`` more: a longer expiry stays, a key
without one gets one. A save that parks a turn keeps them ``ttl_s`` past the end of its wait.
The save that ends a turn sets each of them to expire exactly ``ttl_s`` after it, with the
turn's result (its controls and ``persist: false`` messages are deleted then). So every key of
a live turn outlives it, and an idle session is gone ``ttl_s`` after its last activity. The
results of earlier turns each expire ``ttl_s`` after their own turn's end. A turn's session
index (outside the hash tag) is written with ``ttl_s`` when the turn is accepted, and a save
of the turn gives it the expiry it gives the session's keys.

Every write is one Lua script that first checks the caller still holds the
lease (its token) and that the state's version is the one it loaded, so a
stale worker can never overwrite a newer one.

Round trips per step: the lease script also returns the state and the session history, and
a step's last save also lets go of the lease (``release``), so a step costs three scripts:
lease, model answer, step. Messages are decoded in one batch.

A turn id belongs to the first session that accepts it for as long as the turn's session index
lives (``ttl_s`` from that accept, renewed by every save of the turn; deleting the
session frees it): another session's request with that id is refused (``Accepted("in_use")``)
and writes nothing. On one Redis the accept script checks and writes the index itself; on a
Redis Cluster (``contracts.runtime.redis_client``) every script's keys share the session's hash
tag, and the index, outside it, is claimed by a script of its own first (of two sessions racing
on one id only one gets it); on a cluster every save of a turn renews the index beside its
script at the same time (redis-py's cluster pipeline carries no scripts).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Literal

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from contracts import keys
from contracts.base import Contract
from contracts.codec import decode, encode, encode_stored, read_stored
from contracts.messages import ChatMessage
from contracts.runtime.redis_client import is_cluster
from contracts.state import AgentState, Spend
from contracts.turns import TurnRequest, TurnResult
from worker.loop.transcript import StoredMessages
from worker.session import scripts
from worker.session.blobs import _bytes, _unpack
from worker.session.fleet import FleetLists
from worker.session.handle import SessionHandle
from worker.session.history_cache import HistoryCache, HistoryRead
from worker.session.port import (
    RENEWALS,
    Accepted,
    EndQueued,
    Opening,
    Recorded,
    Renewal,
    StepSession,
)

DEFAULT_TTL_S: Final = 30 * 24 * 3600
Timed = Callable[[str], AbstractContextManager[object]]
"""Wraps one store operation by name (``accept``, ``lease``, ``save`` …), e.g. to time it."""
StateFormat = Literal["json", "msgpack"]


def _untimed(_operation: str) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


class RedisStore(FleetLists):
    """The session store; ``SessionHandle`` is its ``StateStore`` for one leased step."""

    def __init__(
        self,
        redis: Redis,
        *,
        lease_ttl_s: float = 15.0,
        ttl_s: int = DEFAULT_TTL_S,
        timed: Timed = _untimed,
        state_format: StateFormat = "json",
        clock: Callable[[], float] = time.time,
        history_cache: HistoryCache | None = None,
    ) -> None:
        self.redis = redis
        self.history_cache = history_cache
        """The worker's copies of long histories (``None``: every lease reads the whole
        history)."""
        self.cluster = is_cluster(redis)
        """A Redis Cluster client: the session index is written beside the accept script, not
        pipelined with it."""
        self.clock = clock
        self.timed = timed
        self.state_format = state_format
        """How states are written (both are read): ``json``, or ``msgpack`` as versions before
        this one wrote it and read only it — for a rolling upgrade from them."""
        self.lease_ttl_s = lease_ttl_s
        self.lease_ms = int(lease_ttl_s * 1000)
        self.ttl_s = ttl_s
        self._begin = redis.register_script(scripts.BEGIN)
        self._renew = redis.register_script(scripts.RENEW)
        self._release = redis.register_script(scripts.RELEASE)
        self._save = redis.register_script(scripts.SAVE)
        self._accept = redis.register_script(scripts.ACCEPT)
        self._claim = redis.register_script(scripts.CLAIM)
        self._control = redis.register_script(scripts.CONTROL)
        self._spent: dict[str, tuple[float, Spend]] = {}
        self._end_queued = redis.register_script(scripts.END_QUEUED)

    async def accept(self, request: TurnRequest) -> Accepted:
        s, t = request.session_id, request.turn_id
        with self.timed("accept"):
            now = repr(self.clock())
            script_keys = [
                keys.session_turns(s),
                keys.session_requests(s),
                keys.session_queue(s),
                keys.turn_result(s, t),
                keys.session_replies(s),
                keys.session_state(s),
                keys.session_history(s),
                keys.session_fence(s),
                keys.session_erasing(s),
                keys.session_lease(s),
            ]
            args: list[Any] = [t, encode(request), self.ttl_s, request.reply_to or "", now, s]
            index = keys.turn_session(t)
            if self.cluster:
                # the turn's session index hashes to another slot (it is looked up by the
                # turn id alone), likely on another node: claimed first, so that of two
                # sessions accepting one turn id only the one that holds the index goes on
                if not await self._claim(keys=[index], args=[s, self.ttl_s]):
                    return Accepted("in_use")
                status, payload, *at = await self._accept(keys=script_keys, args=args)
            else:
                # one script, the turn's session index with the session's keys (one Redis
                # takes keys of any slot in one script)
                status, payload, *at = await self._accept(keys=[*script_keys, index], args=args)
        return _accepted(status, payload, at)

    async def beside(
        self,
        script: AsyncScript,
        script_keys: list[str],
        args: list[Any],
        other: Callable[[Any], Any],
    ) -> Any:
        """``script``'s reply, run with one command on a key outside the session's hash tag
        (``other(client)``: the turn's session index, looked up by the turn id alone) in one
        round trip: on one Redis in one pipeline, the script by its hash (a pipeline of a
        Script object would first ask whether the script exists: a round trip more; the first
        call, or one after Redis forgot its scripts, loads it); on a cluster, where the index
        likely lives on another node and redis-py's cluster pipeline refuses scripts, both at
        once."""
        if self.cluster:
            reply, _ = await asyncio.gather(script(keys=script_keys, args=args), other(self.redis))
            return reply
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.evalsha(script.sha, len(script_keys), *script_keys, *args)
                other(pipe)
                reply, _ = await pipe.execute()
        except NoScriptError:
            reply = await script(keys=script_keys, args=args)
            await other(self.redis)
        return reply

    async def reply_to(self, session_id: str, turn_id: str) -> tuple[str, ...]:
        value = await self.redis.hget(keys.session_replies(session_id), turn_id)
        return tuple(_bytes(value).decode().split()) if value else ()

    async def session_of(self, turn_id: str) -> str | None:
        with self.timed("read"):
            value = await self.redis.get(keys.turn_session(turn_id))
        return _bytes(value).decode() if value else None

    async def record_control(
        self, session_id: str, turn_id: str, field: str, control: Contract
    ) -> Recorded:
        with self.timed("control"):
            status, *parked = await self._control(
                keys=[
                    keys.session_turns(session_id),
                    keys.turn_controls(session_id, turn_id),
                    keys.session_state(session_id),
                    keys.session_history(session_id),
                    keys.session_fence(session_id),
                    keys.session_queue(session_id),
                    keys.session_requests(session_id),
                    keys.session_replies(session_id),
                    keys.turn_steps(session_id, turn_id),
                ],
                args=[turn_id, field, encode(control), self.ttl_s],
            )
        at = _bytes(parked[0]).decode() if parked else ""
        return Recorded(_bytes(status).decode(), int(at) if at else None)  # type: ignore[arg-type]

    async def note_children(self, session_id: str, child_sessions: Sequence[str]) -> None:
        if child_sessions:
            key = keys.session_children(session_id)
            with self.timed("write"):
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.sadd(key, *child_sessions)
                    pipe.expire(key, self.ttl_s)
                    await pipe.execute()

    async def end_queued(
        self, session_id: str, turn_id: str, result: TurnResult
    ) -> tuple[EndQueued, tuple[str, ...]]:
        with self.timed("control"):
            status, *replies = await self._end_queued(
                keys=[
                    keys.session_turns(session_id),
                    keys.session_queue(session_id),
                    keys.session_requests(session_id),
                    keys.turn_result(session_id, turn_id),
                    keys.session_replies(session_id),
                    keys.turn_controls(session_id, turn_id),
                ],
                args=[turn_id, encode(result), self.ttl_s],
            )
        found = tuple(_bytes(replies[0]).decode().split()) if replies else ()
        return _bytes(status).decode(), found  # type: ignore[return-value]

    async def take(
        self, session_id: str, turn_id: str = "", *, first: bool = False
    ) -> SessionHandle | None:
        """Take the session's lease and load its state and history (what the worker's copy
        of it lacks, ``worker.session.history_cache``), and whether ``turn_id`` was cancelled;
        ``None`` when another worker holds it. ``first`` (a turn's first step): the queue head
        and the turn's request come in the same script."""
        cache = self.history_cache
        copy = cache.get(session_id) if cache is not None else None
        with self.timed("lease"):
            reply = await self._begin(
                keys=[
                    keys.session_lease(session_id),
                    keys.session_fence(session_id),
                    keys.session_state(session_id),
                    keys.session_history(session_id),
                    keys.turn_controls(session_id, turn_id or "_"),
                    keys.session_queue(session_id),
                    keys.session_requests(session_id),
                    keys.session_turns(session_id),
                    keys.session_replies(session_id),
                    keys.turn_steps(session_id, turn_id or "_"),
                ],
                args=[
                    self.lease_ms,
                    self.ttl_s,
                    turn_id if first else "",
                    copy.generation if copy is not None else "",
                    copy.items if copy is not None else 0,
                ],
            )
        if not reply[0]:
            return None
        state = stored = None
        if reply[2]:
            blob = _bytes(reply[2])
            state = read_stored(blob, AgentState)
            if reply[1] is not None:  # the version lives beside the blob
                state = state.model_copy(update={"version": int(reply[1])})
            stored = (state.version, blob)
        history = HistoryRead(
            cache,
            session_id,
            copy,
            _bytes(reply[5]).decode(),
            int(reply[6]),
            int(reply[7]),
            _bytes(reply[3]),
        )
        handle = SessionHandle(self, session_id, int(reply[0]), state, stored, history)
        handle.turn_id = turn_id
        if reply[4]:
            handle.read_controls(reply[4])
        if first:
            head, request = _bytes(reply[8]).decode(), _bytes(reply[9])
            handle.opening = Opening(
                head or None, decode(request, TurnRequest) if request else None
            )
        return handle

    async def renew(self, session: StepSession) -> Renewal:
        sid, turn_id = session.session_id, session.turn_id or "_"
        with self.timed("renew"):
            held = await self._renew(
                keys=[
                    keys.session_lease(sid),
                    keys.turn_controls(sid, turn_id),
                    keys.session_state(sid),
                    keys.session_history(sid),
                    keys.session_fence(sid),
                    keys.session_queue(sid),
                    keys.session_turns(sid),
                    keys.session_requests(sid),
                    keys.session_replies(sid),
                    keys.turn_transient(sid, turn_id),
                    keys.turn_steps(sid, turn_id),
                ],
                args=[session.token, self.lease_ms, self.ttl_s],
            )
        return RENEWALS[int(held)]

    async def release(self, session: StepSession) -> None:
        with self.timed("release"):
            await self._release(keys=[keys.session_lease(session.session_id)], args=[session.token])

    async def head(self, session_id: str) -> str | None:
        with self.timed("read"):
            value = await self.redis.lindex(keys.session_queue(session_id), 0)
        return value.decode() if isinstance(value, bytes) else value

    async def request(self, session_id: str, turn_id: str) -> TurnRequest | None:
        with self.timed("read"):
            blob = await self.redis.hget(keys.session_requests(session_id), turn_id)
        return decode(_bytes(blob), TurnRequest) if blob else None

    async def stored_state(self, session_id: str) -> AgentState | None:
        with self.timed("read"):
            blob = await self.redis.hget(keys.session_state(session_id), "s")
        return read_stored(_bytes(blob), AgentState) if blob else None

    async def result(self, session_id: str, turn_id: str) -> TurnResult | None:
        with self.timed("read"):
            blob = await self.redis.get(keys.turn_result(session_id, turn_id))
        return decode(_bytes(blob), TurnResult) if blob else None

    async def history(self, session_id: str) -> list[ChatMessage]:
        items = await self.redis.lrange(keys.session_history(session_id), 0, -1)
        return list(StoredMessages(_unpack(items)))

    def encode_state(self, state: AgentState) -> bytes:
        if self.state_format == "msgpack":
            return encode(state.model_copy(update={"version": 0}))  # as earlier versions wrote it
        return encode_stored(state, exclude={"version"})  # the version lives beside the blob


def _accepted(status: bytes | str, payload: Any, at: list[Any]) -> Accepted:
    status = status.decode() if isinstance(status, bytes) else status
    if status == "done":
        return Accepted("done", result=decode(payload, TurnResult))
    accepted_at = _time(at[0]) if at else None
    if status == "queued":
        return Accepted("queued", ahead=int(payload), accepted_at=accepted_at)
    if status == "in_use":
        return Accepted("in_use")
    if status == "erasing":
        return Accepted("erasing")
    return Accepted("start" if status == "start" else "pending", accepted_at=accepted_at)


def _time(value: bytes | str) -> float | None:
    """A time the accept script kept; ``None`` for a turn accepted by an earlier version."""
    try:
        return float(_bytes(value))
    except ValueError:
        return None
