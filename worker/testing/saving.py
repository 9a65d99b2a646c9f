"""The in-memory store's save, as the Redis store's save script does it
(``worker.session.scripts.SAVE``): the state on its version, the messages on the history or
on a ``persist: false`` turn's own list, a turn's end, and the expiry each gives the session's
keys. Mixed into ``MemoryStore`` (``worker.testing.memory``), over its expiry rules."""

from __future__ import annotations

from collections.abc import Sequence

from contracts import keys
from contracts.codec import encode, read_stored
from contracts.messages import ChatMessage
from contracts.state import AgentState, StepExecution
from contracts.turns import TurnRequest, TurnResult
from worker.errors import StaleStateError
from worker.testing.expiring import ExpiryRules


class SaveScript(ExpiryRules):
    """Mixed into ``MemoryStore``: what it has that these use."""

    states: dict[str, AgentState]
    histories: dict[str, list[ChatMessage]]
    transient: dict[tuple[str, str], list[ChatMessage]]
    steps: dict[tuple[str, str], list[StepExecution]]
    turns: dict[str, dict[str, str]]
    queues: dict[str, list[str]]
    requests: dict[str, dict[str, TurnRequest]]

    def _write(
        self,
        state: AgentState,
        append: Sequence[ChatMessage],
        result: TurnResult | None,
        step: StepExecution | None = None,
        cut_to: int | None = None,
    ) -> tuple[AgentState, str | None]:
        """The save script: the state on its version, the messages, the step's record, the
        history cut back (``cut_to``: a rollback), and a turn's end."""
        self.keys.sweep()
        sid = state.session_id
        stored = self.states.get(sid)
        if (stored.version if stored else 0) != state.version:
            raise StaleStateError(f"session {sid} was written by someone else")
        ex = state.execution
        saved = state.model_copy(update={"version": state.version + 1})
        self.states[sid] = saved
        self.keys.written(keys.session_state(sid), self._pop(self.states, sid))
        if append:
            self._append(sid, ex.turn_id if ex and not ex.request.persist else None, append)
        head = None
        turn_id = ex.turn_id if ex is not None else (result.turn_id if result else "")
        if step is not None:
            # as stored in Redis: encoded and read back (the stored form, ``stored``)
            record = read_stored(encode(step.stored()), StepExecution)
            self.steps.setdefault((sid, turn_id), []).append(record)
            self._expire(keys.turn_steps(sid, turn_id), self._pop(self.steps, (sid, turn_id)))
        if cut_to is not None and sid in self.histories:
            del self.histories[sid][cut_to:]
            if not self.histories[sid]:  # as Redis deletes an emptied list
                del self.histories[sid]
                self.keys.deleted(keys.session_history(sid))
        if result is not None:
            head = self._end(sid, result)
            self._index_lives(result.turn_id, self.ttl_s)
        else:
            lifetime = self._lifetime(state)
            self._keep(lifetime, self._kept(sid, turn_id))
            self._index_lives(turn_id, lifetime)
        return saved, head

    def _append(self, sid: str, transient: str | None, append: Sequence[ChatMessage]) -> None:
        """The messages on the session's history, or on a ``persist: false`` turn's list."""
        if transient is None:
            self.histories.setdefault(sid, []).extend(append)
            self._expire(keys.session_history(sid), self._pop(self.histories, sid))
        else:
            self.transient.setdefault((sid, transient), []).extend(append)
            key = keys.turn_transient(sid, transient)
            self._expire(key, self._pop(self.transient, (sid, transient)))

    def _end(self, sid: str, result: TurnResult) -> str | None:
        """A turn's end, in the save script: its result, its status, the queue moves on; the
        session's keys expire ``ttl_s`` from now. The session's next turn, if any."""
        t = result.turn_id
        self._set_result(sid, t, result)
        self.turns.setdefault(sid, {})[t] = "done"
        queue = self.queues.get(sid, [])
        if queue and queue[0] == t:
            queue.pop(0)
        self._emptied(keys.session_queue(sid), self.queues, sid)
        self.requests.get(sid, {}).pop(t, None)
        self._emptied(keys.session_requests(sid), self.requests, sid)
        if self.transient.pop((sid, t), None) is not None:
            self.keys.deleted(keys.turn_transient(sid, t))
        self._drop_controls((sid, t))
        for key in [*self._kept(sid), keys.turn_steps(sid, t)]:
            self.keys.expire(key, self.ttl_s)
        return queue[0] if queue else None
