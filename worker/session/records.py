"""A session's records read and erased as a resource (``contracts.sessions``), straight from
Redis: reads take no lease and never wait for a running turn; erasure is run by the sequencer
once no turn of the session runs, under its lease (renewed while it works).

Erasure first marks the session (``erasing``, in the script that checks the lease and that no
turn is queued): while the mark's token is the session's lease (renewed by the sequencer) an
accept writes nothing and the request comes back later, so no turn can be accepted into what
is being deleted. It then deletes, by name, the tool-call idempotency records of its calls
(``lw:toolcall:{<turn id>:<call id>}``, named by the session's ``calls`` set, which records
each call's idempotency key with the model answer that asked for it); every key with the
session's hash tag (state, history, queue, turns, requests, replies, each turn's result,
controls and ``persist: false`` messages, the redaction mapping, the notes and their
idempotency record, the lists of child sessions and of calls, the lease), each batch in a
script that checks the lease and the mark; each turn's session index, while it names this
session; and its entries in the list of calls waiting for a decision. No scan of the
keyspace. A key added under the session's hash tag is added to ``_own_keys``
(``tests/unit/test_erasure.py`` checks). The fence (a bare counter, no user data) stays,
with its expiry (``ttl_s`` from the lease the erasure ran under): a worker that still holds a
token from before the erasure can never write to the session started after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from contracts import keys
from contracts.codec import decode, read_stored
from contracts.control import ApprovalRequest
from contracts.messages import ChatMessage
from contracts.sessions import SessionSummary, TurnInfo, TurnStatus
from contracts.state import AgentState, StepExecution
from contracts.turns import TurnResult
from worker.loop.transcript import StoredMessages
from worker.session import scripts
from worker.session.blobs import _bytes, _unpack

SCAN_COUNT = 500
ERASE_BATCH = 500
"""Keys per script or command of an erasure."""
MARK_TTL_MS = 600_000
"""How long an erasure's mark lives, renewed by each batch deleted. It holds accepts back only
while its token is the session's lease (a worker that dies erasing holds them back until its
lease expires; the redelivered ``session.delete`` starts again)."""


@dataclass(frozen=True, slots=True)
class StepPage:
    records: tuple[StepExecution, ...]
    """The page, oldest first."""
    total: int
    """The turn's step records, all pages."""
    expired: bool = False
    """None are left of a turn that completed steps: they lived ``ttl_s`` past its end."""


@dataclass(frozen=True, slots=True)
class Erased:
    deleted: int
    """Keys deleted."""
    children: tuple[str, ...]
    """The child sessions the session's turns started (each to be deleted in turn)."""


class SessionRecords:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._mark = redis.register_script(scripts.ERASE_MARK)
        self._erase = redis.register_script(scripts.ERASE_KEYS)
        self._drop_index = redis.register_script(scripts.DROP_INDEX)

    async def state(self, session_id: str) -> AgentState | None:
        blob = await self.redis.hget(keys.session_state(session_id), "s")
        return read_stored(_bytes(blob), AgentState) if blob else None

    async def summary(self, session_id: str) -> SessionSummary | None:
        state = await self.state(session_id)
        if state is None:
            return None
        queue = [_text(t) for t in await self.redis.lrange(keys.session_queue(session_id), 0, -1)]
        ex = state.execution
        running = queue[0] if queue else None
        return SessionSummary(
            session_id=session_id,
            agent=state.agent,
            turns=state.execution_count,
            history_len=state.history_len,
            spent=state.spent,
            created_at=state.created_at,
            updated_at=state.updated_at,
            running=running,
            parked=bool(ex is not None and ex.turn_id == running and ex.status == "waiting"),
            queued=max(0, len(queue) - 1),
        )

    async def history(
        self, session_id: str, offset: int, limit: int, newest_first: bool
    ) -> tuple[list[ChatMessage], int]:
        """A page of the history (oldest first, or newest first), and the history's length."""
        key = keys.session_history(session_id)
        total = int(await self.redis.llen(key))
        if newest_first:
            stop, start = total - 1 - offset, max(0, total - offset - limit)
        else:
            start, stop = offset, min(total, offset + limit) - 1
        if start > stop or start >= total:
            return [], total
        items = await self.redis.lrange(key, start, stop)
        messages = list(StoredMessages(_unpack(items)))
        return (messages[::-1] if newest_first else messages), total

    async def turns(self, session_id: str) -> list[TurnInfo]:
        statuses = await self.redis.hgetall(keys.session_turns(session_id))
        queue = [_text(t) for t in await self.redis.lrange(keys.session_queue(session_id), 0, -1)]
        state = await self.state(session_id) if queue else None
        found: list[TurnInfo] = []
        done = [_text(t) for t, s in statuses.items() if _text(s) == "done"]
        results = await self._results(session_id, done)
        for raw, raw_status in statuses.items():
            turn_id, stored = _text(raw), _text(raw_status)
            status: TurnStatus = "done" if stored == "done" else "queued"
            if stored != "done" and queue and turn_id == queue[0]:
                ex = state.execution if state else None
                parked = ex is not None and ex.turn_id == turn_id and ex.status == "waiting"
                status = "waiting" if parked else "running"
            result = results.get(turn_id)
            found.append(
                TurnInfo(
                    turn_id=turn_id,
                    status=status,
                    finish_reason=result.finish_reason if result else None,
                )
            )
        order = {t: i for i, t in enumerate(queue)}
        return sorted(
            found, key=lambda t: (t.status != "done", order.get(t.turn_id, -1), t.turn_id)
        )

    async def result(self, turn_id: str, session_id: str | None = None) -> TurnResult | None:
        if session_id is None:
            found = await self.redis.get(keys.turn_session(turn_id))
            if not found:
                return None
            session_id = _text(found)
        blob = await self.redis.get(keys.turn_result(session_id, turn_id))
        return decode(_bytes(blob), TurnResult) if blob else None

    async def step_text(self, session_id: str, turn_id: str, step: int) -> str | None:
        """The saved text of one step's answer (``""`` for an answer with none): from the
        pending step while it runs, from the turn's step list once the step completed (kept
        ``ttl_s`` past the turn's end), from the result for the last step of a turn whose list
        is gone; None when it is not saved (yet, or any more)."""
        state = await self.state(session_id)
        ex = state.execution if state is not None else None
        inline = 0
        if ex is not None and ex.turn_id == turn_id:
            pending = ex.pending
            if pending is not None and pending.index == step and pending.response is not None:
                return pending.response.message.content or ""
            if step >= ex.step_count:
                return None
            if step < len(ex.steps):  # completed before the upgrade to step lists
                return _answer_text(ex.steps[step])
            inline = len(ex.steps)
        record = await self._stored_step(session_id, turn_id, step, step - inline)
        if record is not None:
            return _answer_text(record)
        result = await self.result(turn_id, session_id)
        if result is not None and result.steps == step + 1:
            return result.content or ""
        return None

    async def steps(
        self, session_id: str, turn_id: str, offset: int, limit: int
    ) -> StepPage | None:
        """A page of the records of the turn's completed steps, oldest first, from ``offset``:
        those an earlier release kept inline in the state of a turn still in progress (given
        the shape of the step list's, ``StepExecution.stored``), then the turn's step list.
        ``None`` for a turn the session does not know (or no more)."""
        state = await self.state(session_id)
        ex = state.execution if state is not None else None
        inline = [r.stored() for r in ex.steps] if ex is not None and ex.turn_id == turn_id else []
        listed, total = await self._listed(
            keys.turn_steps(session_id, turn_id), offset - len(inline), limit
        )
        total += len(inline)
        if total:
            return StepPage((*inline[offset : offset + limit], *listed), total)
        expired = await self._records_expired(session_id, turn_id)
        return None if expired is None else StepPage((), 0, expired=expired)

    async def _listed(self, key: str, offset: int, limit: int) -> tuple[list[StepExecution], int]:
        """A page of a step list (``offset`` may be negative: the page starts before it), and
        its length, counted after the page is read (the list only grows: never less)."""
        start, stop = max(0, offset), offset + limit - 1
        async with self.redis.pipeline(transaction=False) as pipe:
            if stop >= start:
                pipe.lrange(key, start, stop)
            pipe.llen(key)
            *page, length = await pipe.execute()
        items = page[0] if page else []
        return [read_stored(_bytes(item), StepExecution) for item in items], int(length)

    async def _records_expired(self, session_id: str, turn_id: str) -> bool | None:
        """Whether a turn with no step records completed steps all the same: one that ended
        after a step (or whose result expired with its step list, ``ttl_s`` past its end); not
        one queued, running its first step or ended before it. ``None`` for a turn the session
        does not know."""
        status = await self.redis.hget(keys.session_turns(session_id), turn_id)
        if status is None:
            return None
        if _text(status) != "done":
            return False
        result = await self.result(turn_id, session_id)
        return result is None or result.steps > 0

    async def _stored_step(
        self, session_id: str, turn_id: str, step: int, at: int
    ) -> StepExecution | None:
        """Step ``step``'s record in the turn's step list, looked for at ``at``; a turn whose
        first steps were kept inline by an earlier release (the list starts later) is read at
        the offset its first record shows."""
        key = keys.turn_steps(session_id, turn_id)
        for _ in range(2):
            blob = await self.redis.lindex(key, at) if at >= 0 else None
            record = read_stored(_bytes(blob), StepExecution) if blob else None
            if record is not None and record.step.index == step:
                return record
            first = await self.redis.lindex(key, 0)
            if not first:
                return None
            at = step - read_stored(_bytes(first), StepExecution).step.index
        return None

    async def unfinished(self, session_id: str) -> list[str]:
        """The session's turns not finished yet, the running one first."""
        return [_text(t) for t in await self.redis.lrange(keys.session_queue(session_id), 0, -1)]

    async def erase(self, session_id: str, token: int) -> Erased | None:
        """Delete everything of the session under its lease (``token``, renewed by the caller
        meanwhile); ``None`` when the lease was lost or a turn is queued (judged again)."""
        lease, mark = keys.session_lease(session_id), keys.session_erasing(session_id)
        queue = keys.session_queue(session_id)
        if not await self._mark(keys=[lease, mark, queue], args=[token, MARK_TTL_MS]):
            return None
        turn_ids = [_text(t) for t in await self.redis.hkeys(keys.session_turns(session_id))]
        children = [_text(c) for c in await self.redis.smembers(keys.session_children(session_id))]
        # the tool services' records of its calls first: the set that names them is the
        # session's own, deleted below (an erasure retried after a crash finds them again)
        deleted = await self._unlink(await self._tool_calls(session_id))
        own = _own_keys(session_id, turn_ids)
        for start in range(0, len(own), ERASE_BATCH):
            last = "1" if start + ERASE_BATCH >= len(own) else "0"
            batch = own[start : start + ERASE_BATCH]
            n = int(await self._erase(keys=[lease, mark, *batch], args=[token, MARK_TTL_MS, last]))
            if n < 0:
                return None
            deleted += n
        # each finished turn's session index, outside its hash tag: nothing writes to it any
        # more
        for turn_id in turn_ids:  # only while it is this session's (an old turn's id may be
            # another session's now)
            deleted += int(
                await self._drop_index(keys=[keys.turn_session(turn_id)], args=[session_id])
            )
        await self._clear_waiting(session_id, set(turn_ids))
        return Erased(deleted, tuple(sorted(children)))

    async def _unlink(self, names: list[str]) -> int:
        """Delete keys outside the session's hash tag, a batch at a time; how many there were."""
        deleted = 0
        for start in range(0, len(names), ERASE_BATCH):
            deleted += int(await self.redis.unlink(*names[start : start + ERASE_BATCH]))
        return deleted

    async def _tool_calls(self, session_id: str) -> list[str]:
        """The tool services' idempotency records (and leases) of the session's tool calls, by
        name: the session recorded each call's idempotency key when its model answer asked
        for it."""
        calls = [_text(k) for k in await self.redis.smembers(keys.session_calls(session_id))]
        return [name for k in calls for name in (keys.tool_call(k), keys.tool_call_lease(k))]

    async def _clear_waiting(self, session_id: str, turn_ids: set[str]) -> None:
        """The session's entries in the fleet-wide list of calls waiting for a decision (a
        turn id the session used long ago may be another session's now)."""
        waiting = keys.approvals_waiting()
        fields = [
            _text(f)
            async for f, v in self.redis.hscan_iter(waiting, count=SCAN_COUNT)
            if _text(f).split(":", 1)[0] in turn_ids
            and ApprovalRequest.model_validate_json(v).session_id == session_id
        ]
        for start in range(0, len(fields), ERASE_BATCH):
            await self.redis.hdel(waiting, *fields[start : start + ERASE_BATCH])

    async def _results(self, session_id: str, turn_ids: list[str]) -> dict[str, TurnResult]:
        if not turn_ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for turn_id in turn_ids:
                pipe.get(keys.turn_result(session_id, turn_id))
            blobs = await pipe.execute()
        return {t: decode(_bytes(b), TurnResult) for t, b in zip(turn_ids, blobs, strict=True) if b}


def _own_keys(session_id: str, turn_ids: list[str]) -> list[str]:
    """Every key of the session under its hash tag, by name, but its lease, its fence and the
    erasure's mark: each turn's first, the turns hash last (a retry finds the turns again)."""
    found: list[str] = []
    for turn_id in turn_ids:
        found += [
            keys.turn_result(session_id, turn_id),
            keys.turn_controls(session_id, turn_id),
            keys.turn_transient(session_id, turn_id),
            keys.turn_steps(session_id, turn_id),
        ]
    return [
        *found,
        keys.session_state(session_id),
        keys.session_history(session_id),
        keys.session_queue(session_id),
        keys.session_requests(session_id),
        keys.session_replies(session_id),
        keys.redaction_map(session_id),
        keys.session_notes(session_id),
        keys.session_notes_filed(session_id),
        keys.session_children(session_id),
        keys.session_calls(session_id),
        keys.session_thread(session_id),
        keys.session_turns(session_id),
    ]


def _answer_text(record: StepExecution) -> str | None:
    response = record.step.response
    return (response.message.content or "") if response is not None else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
