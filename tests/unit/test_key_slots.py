"""Every Lua script keeps its keys in one Redis Cluster hash slot.

A script whose keys hash to two slots fails with ``CROSSSLOT`` on a cluster. Each case below
runs the real code that calls a script against a client that never connects: it records the
keys of every ``EVALSHA`` and stops there. The keys the code builds (``contracts.keys``) must
map to one slot (``redis.crc.key_slot``, what the cluster client routes by). A module that
registers a script and has no case here fails ``test_every_script_has_a_case``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from contracts import keys, tenancy
from contracts.control import TurnCancel
from contracts.registry import live_tools
from contracts.state import AgentState
from contracts.turns import InputMessage, TurnRequest, TurnResult
from tool_services.calls import CallStore, Claim, ClaimKind
from tool_services.notes.service import FileNoteArgs, file_note
from tool_services.registry import Announcer
from tool_services.sdk import CallContext
from worker.model.ratelimit import RedisRateLimiter
from worker.redaction.vault import RedisVault
from worker.session.handle import SessionHandle
from worker.session.history_cache import HistoryRead
from worker.session.records import SessionRecords
from worker.session.store import RedisStore
from worker.session.tenant_slots import TenantSlots

ROOT = Path(__file__).resolve().parents[2]
SESSION = "s-slot-1"
TURN = "t-slot-1"
CALL = f"{TURN}:call_{{1}}}}"
"""An idempotency key: a call id comes from the model and may hold braces."""


class Stop(Exception):
    """Raised where the script would run: the keys are recorded, nothing else matters."""


class Recorder(Redis):
    """A Redis client that never connects: ``EVALSHA`` records its keys and stops (or gives
    the next of ``answers``, for a script called before the one a case is about); a
    ``HGETALL`` answers an undecodable entry (so the registry drops it with its script)."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[list[str]] = []
        self.answers: list[Any] = []
        """What the first scripts answer (the last one called stops)."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "EVALSHA":
            numkeys = int(args[2])
            self.scripts.append([str(k) for k in args[3 : 3 + numkeys]])
            if self.answers:
                return self.answers.pop(0)
            raise Stop
        if args[0] == "HGETALL":
            return {b"instance-1": b"\xc1 not msgpack"}
        return None

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Any:
        return _Pipeline(self)


class _Pipeline:
    """What ``RedisStore.beside`` pipelines (accepting a turn, a save that ends or parks one):
    the script's keys are recorded as above."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.evalshas: list[tuple[Any, ...]] = []

    async def __aenter__(self) -> _Pipeline:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        return None

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> None:
        self.recorder.scripts.append([str(k) for k in keys_and_args[:numkeys]])

    def set(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def expire(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    async def execute(self) -> Any:
        raise Stop


def _state() -> AgentState:
    return AgentState(session_id=SESSION, agent="support", created_at=1.0, updated_at=2.0)


def _request() -> TurnRequest:
    return TurnRequest(
        turn_id=TURN, session_id=SESSION, agent="support", input=[InputMessage(content="hi")]
    )


def _result() -> TurnResult:
    return TurnResult(
        turn_id=TURN,
        session_id=SESSION,
        agent="support",
        content="done",
        finish_reason="stop",
        steps=1,
        duration_s=0.1,
        completed_at=3.0,
    )


def _context(redis: Redis) -> CallContext:
    return CallContext(
        call_id="call_1",
        tool="file_note",
        session_id=SESSION,
        turn_id=TURN,
        agent="support",
        metadata={},
        deadline=1e12,
        idempotency_key=f"{TURN}:call_1",
        redis=redis,
    )


class Marked(Recorder):
    """A session with nothing in it whose erasure's mark was set (its first script passes)."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "EVALSHA" and not self.scripts:
            self.scripts.append([])
            return 1
        if args[0] == "SCAN":
            return 0, []
        if args[0] in ("HKEYS", "SMEMBERS"):
            return []
        return await super().execute_command(*args, **options)


async def _erase_keys(r: Recorder) -> None:
    marked = Marked()
    try:
        await SessionRecords(marked).erase(SESSION, 7)
    finally:
        r.scripts = marked.scripts[1:]


Case = Callable[[Recorder], Awaitable[Any]]


def _store(r: Recorder) -> RedisStore:
    return RedisStore(r)


def _on_a_cluster(r: Recorder, *answers: Any) -> RedisStore:
    """The store as it runs on a Redis Cluster; the first scripts answer ``answers``."""
    store = _store(r)
    store.cluster = True
    r.answers = list(answers)
    return store


def _handle(r: Recorder) -> SessionHandle:
    """A step's handle as it runs on a Redis Cluster (on one Redis the save script also renews
    the turn's session index, in another slot: one Redis takes that)."""
    store = _on_a_cluster(r)
    history = HistoryRead(None, SESSION, None, "", 0, 0, b"")
    return SessionHandle(store, SESSION, 7, _state(), None, history)


def _calls(r: Recorder) -> CallStore:
    return CallStore(r, instance_id="i", lease_ms=1000, ttl_s=60)


def _claim() -> Claim:
    return Claim(ClaimKind.RUN, CALL, "token")


CASES: dict[str, tuple[str, Case]] = {
    # worker/session/scripts.py, through the session store
    "BEGIN": ("worker/session/store.py", lambda r: _store(r).take(SESSION, TURN)),
    "RENEW": ("worker/session/store.py", lambda r: _store(r).renew(_handle(r))),
    "RELEASE": ("worker/session/store.py", lambda r: _store(r).release(_handle(r))),
    # on one Redis, the accept script also checks and writes the turn's session index
    # (another slot); on a cluster the index is claimed by a script of its own first
    "CLAIM": ("worker/session/store.py", lambda r: _on_a_cluster(r).accept(_request())),
    "ACCEPT": ("worker/session/store.py", lambda r: _on_a_cluster(r, 1).accept(_request())),
    "CONTROL": (
        "worker/session/store.py",
        lambda r: _store(r).record_control(SESSION, TURN, "cancel", TurnCancel(turn_id=TURN)),
    ),
    "END_QUEUED": (
        "worker/session/store.py",
        lambda r: _store(r).end_queued(SESSION, TURN, _result()),
    ),
    "ERASE_MARK": ("worker/session/records.py", lambda r: SessionRecords(r).erase(SESSION, 7)),
    "ERASE_KEYS": ("worker/session/records.py", _erase_keys),
    "SAVE": ("worker/session/store.py", lambda r: _handle(r).save(_state(), result=_result())),
    "SAVE without a result": ("worker/session/store.py", lambda r: _handle(r).save(_state())),
    "tenant slot ADMIT": (
        "worker/session/tenant_slots.py",
        lambda r: TenantSlots(r, default_cap=1).admit("acme", TURN, SESSION, 1.0),
    ),
    "tenant slot RELEASE": (
        "worker/session/tenant_slots.py",
        lambda r: TenantSlots(r, default_cap=1).release("acme", TURN, 1.0),
    ),
    "ADMIT": (
        "worker/model/ratelimit.py",
        lambda r: RedisRateLimiter(
            r, endpoint="http://model/v1", requests_per_minute=60, tokens_per_minute=6000
        ).admit([], 100),
    ),
    "tenant rate ADMIT": (
        "worker/model/ratelimit.py",
        lambda r: RedisRateLimiter(
            r, requests_per_minute=60, tokens_per_minute=6000, tenant="acme"
        ).admit([], 100),
    ),
    "tenant rate REFUND": (
        "worker/model/ratelimit.py",
        lambda r: RedisRateLimiter(
            r, requests_per_minute=60, tokens_per_minute=6000, tenant="acme"
        ).refund([], 100),
    ),
    "redaction ASSIGN": (
        "worker/redaction/vault.py",
        lambda r: RedisVault(r).assign(SESSION, [("EMAIL", "a@b.example", "a@b.example")], 60),
    ),
    "tool call CLAIM": ("tool_services/calls.py", lambda r: _calls(r).claim(CALL, idempotent=True)),
    "tool call REFRESH": ("tool_services/calls.py", lambda r: _calls(r).refresh(_claim())),
    "tool call STORE": (
        "tool_services/calls.py",
        lambda r: _calls(r).store(CALL, b"reply", "ok", token="token"),
    ),
    "tool call RELEASE": (
        "tool_services/calls.py",
        lambda r: _calls(r).release(_claim(), forget_owner=True),
    ),
    "notes APPEND": (
        "tool_services/notes/service.py",
        lambda r: file_note(FileNoteArgs(text="call back"), _context(r)),
    ),
    "registry DROP_IF_UNCHANGED": ("contracts/registry.py", lambda r: live_tools(r)),
    "registry ANNOUNCE": (
        "tool_services/registry.py",
        lambda r: Announcer(
            r, service="svc", instance_id="i-1", tools=(), interval_s=5, ttl_s=45
        ).announce(),
    ),
}


@pytest.mark.parametrize("tenant", [None, "acme"])
@pytest.mark.parametrize("name", sorted(CASES))
async def test_a_script_keeps_its_keys_in_one_slot(name: str, tenant: str | None) -> None:
    """With tenancy off, and within a tenant (whose name goes inside the hash tag)."""
    recorder = Recorder()
    with tenancy.acting_for(tenant), pytest.raises(Stop):
        await CASES[name][1](recorder)
    script_keys = recorder.scripts[-1]
    assert script_keys, "the script was called without keys"
    slots = {key: key_slot(key.encode()) for key in script_keys}
    assert len(set(slots.values())) == 1, f"{name} spans slots: {slots}"


def test_every_script_has_a_case() -> None:
    """Every module of the project that registers a Lua script is exercised above."""
    registering = set()
    for package in ("contracts", "worker", "tool_services"):
        for path in (ROOT / package).rglob("*.py"):
            if re.search(r"\.register_script\(|\.eval(sha)?\(", path.read_text(encoding="utf-8")):
                registering.add(str(path.relative_to(ROOT)))
    assert registering == {module for module, _ in CASES.values()}


async def test_a_turns_step_list_is_in_its_sessions_slot() -> None:
    """The save that completes a step appends its record to the turn's step list: the list is
    one of the save script's keys, in the session's slot (and so on a cluster's node)."""
    recorder = Recorder()
    with pytest.raises(Stop):
        await _handle(recorder).save(_state(), result=_result())
    script_keys = recorder.scripts[-1]
    assert keys.turn_steps(SESSION, TURN) in script_keys
    assert key_slot(keys.turn_steps(SESSION, TURN).encode()) == key_slot(
        keys.session_state(SESSION).encode()
    )


def test_a_tenants_session_keys_are_its_own_and_in_one_slot() -> None:
    """Two tenants' sessions of one id are two sets of keys, each in one slot; the default
    tenant keeps the keys of a fleet without tenancy."""
    built: dict[str | None, list[str]] = {}
    for tenant in (None, "default", "acme", "globex"):
        with tenancy.acting_for(tenant):
            built[tenant] = [
                keys.session_state(SESSION),
                keys.session_history(SESSION),
                keys.turn_steps(SESSION, TURN),
                keys.session_lease(SESSION),
                keys.turn_result(SESSION, TURN),
                keys.session_thread(SESSION),
            ]
        assert len({key_slot(k.encode()) for k in built[tenant]}) == 1, built[tenant]
    assert built[None] == built["default"]
    assert built["acme"][0] == "lw:{acme/s-slot-1}:state"
    assert not set(built["acme"]) & set(built["globex"])
    assert not set(built["acme"]) & set(built[None])
