"""Contract rules that publishers and subscribers rely on."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import pickle
import pkgutil
import re
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import contracts
from contracts import keys, topology
from contracts.base import _NOT_TRACKED, Contract
from contracts.codec import decode_obj, encode
from contracts.events import (
    EVENT_SOURCE,
    EVENT_TYPES,
    UNKNOWN,
    ApprovalDecided,
    ApprovalRequested,
    BudgetExhausted,
    Event,
    EventData,
    StepCompleted,
    ToolInvoked,
    ToolInvoking,
    TurnAccepted,
    TurnFinished,
    TurnRejected,
    TurnStarted,
    event_id,
    finish_event_type,
    make_event,
)
from contracts.messages import ChatMessage, Usage
from contracts.sessions import SessionQuery, SessionReply
from contracts.state import AgentState, AgentStep, SessionContext, StepExecution
from contracts.tools import ToolCallReply, ToolDefinition, idempotency_key
from contracts.turns import (
    Budget,
    LimitOverrides,
    LoopLimits,
    TurnError,
    TurnRequest,
    TurnResult,
)
from contracts.work import StepWork
from tests.unit.event_samples import LATER_EVENT_DATA
from worker.profiles.agents import AgentProfile

RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z$")


def all_contract_classes() -> list[type[Contract]]:
    """Every Contract subclass defined in the contracts package."""
    for module in pkgutil.iter_modules(contracts.__path__):
        importlib.import_module(f"contracts.{module.name}")
    found: list[type[Contract]] = []
    pending: list[type[Contract]] = [Contract]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("contracts.") and sub not in found:
                found.append(sub)
                pending.append(sub)
    return sorted(found, key=lambda cls: cls.__name__)


def result(**changes: Any) -> TurnResult:
    data: dict[str, Any] = {
        "turn_id": "T1",
        "session_id": "S1",
        "agent": "support",
        "content": "done",
        "finish_reason": "stop",
        "steps": 1,
        "duration_s": 0.5,
        "completed_at": 1_700_000_000.0,
    }
    data.update(changes)
    return TurnResult.model_validate(data)


def request(**changes: Any) -> TurnRequest:
    data: dict[str, Any] = {
        "turn_id": "T1",
        "session_id": "S1",
        "agent": "support",
        "input": [{"content": "hi"}],
    }
    data.update(changes)
    return TurnRequest.model_validate(data)
    reply = SessionReply(ok=True, total=0)
    assert "steps" not in decode_obj(encode(reply))
    record = StepExecution(step=AgentStep(index=0, input_count=2), started_at=1.0, completed_at=2.0)
    steps = decode_obj(encode(SessionReply(ok=True, steps=(record,), total=1)))["steps"]
    assert [s["step"]["index"] for s in steps] == [0]


def test_a_steps_query_names_its_turn_and_may_leave_out_its_session() -> None:
    with pytest.raises(ValidationError, match="op 'steps' needs turn_id"):
        SessionQuery(op="steps", session_id="S1")
    query = SessionQuery(op="steps", turn_id="T1", offset=2, limit=5)
    assert (query.session_id, query.offset, query.limit) == (None, 2, 5)
    with pytest.raises(ValidationError):
        SessionQuery(op="steps", turn_id="T1", limit=1001)


EVENT_DATA: dict[str, EventData] = {
    "turn.accepted": TurnAccepted(persist=True, input_messages=1),
    "turn.started": TurnStarted(history_len=0, max_tool_iterations=7),
    "step.completed": StepCompleted(
        step_type="final_response",
        finish_reason="stop",
        tool_calls=0,
        usage=Usage(),
        duration_s=0.1,
        model_duration_s=0.1,
    ),
    "tool.invoking": ToolInvoking(tool="search", call_id="c1"),
    "tool.invoked": ToolInvoked(tool="search", call_id="c1", outcome="ok", duration_s=0.1),
    "turn.completed": TurnFinished(result=result()),
    "turn.failed": TurnFinished(
        result=result(finish_reason="error", error=TurnError(code="x", message="boom"))
    ),
    "turn.cancelled": TurnFinished(result=result(finish_reason="cancelled", stopped_by="user")),
    "turn.rejected": TurnRejected(reason="bad", code="malformed"),
    "approval.requested": ApprovalRequested(call_id="c1", tool="refund", arguments="{}"),
    "approval.decided": ApprovalDecided(call_id="c1", decision="approve", by="maria"),
    "budget.exhausted": BudgetExhausted(
        budget="turn.max_tool_calls", limit=3, used=3, final_call=True
    ),
    **LATER_EVENT_DATA,
}


def event(event_type: Any = "tool.invoked", **kwargs: Any) -> Event:
    options: dict[str, Any] = {"agent": "support", "time": 1_700_000_000.0, "turn_id": "T1"}
    options.update(kwargs)
    return make_event(event_type, EVENT_DATA[event_type], **options)


# --------------------------------------------------------------------------- frozen, no extras


SAMPLES: dict[str, BaseModel] = {
    "TurnRequest": request(),
    "TurnResult": result(),
    "LimitOverrides": LimitOverrides(max_tool_iterations=3),
    "LoopLimits": LoopLimits(),
    "Event": event(),
    "ToolDefinition": ToolDefinition(name="search"),
    "ToolCallReply": ToolCallReply(call_id="c1", status="ok"),
    "ChatMessage": ChatMessage.user("hi"),
    "AgentState": AgentState(session_id="S1", agent="support", created_at=1.0, updated_at=1.0),
}


@pytest.mark.parametrize("model", SAMPLES.values(), ids=SAMPLES.keys())
def test_models_are_frozen(model: BaseModel) -> None:
    field = next(iter(type(model).model_fields))
    before = getattr(model, field)
    with pytest.raises(ValidationError, match="frozen"):
        setattr(model, field, before)
    assert getattr(model, field) == before


@pytest.mark.parametrize("model", SAMPLES.values(), ids=SAMPLES.keys())
def test_models_forbid_extra_fields(model: BaseModel) -> None:
    data = {**model.model_dump(), "unexpected": 1}
    with pytest.raises(ValidationError) as info:
        type(model).model_validate(data)
    assert [err["type"] for err in info.value.errors()] == ["extra_forbidden"]


def test_every_contract_is_frozen_and_forbids_extra_fields() -> None:
    classes = all_contract_classes()
    assert len(classes) > 20, "the contracts package should define many contracts"
    for cls in classes:
        assert cls.model_config.get("frozen") is True, f"{cls.__name__} is not frozen"
        assert cls.model_config.get("extra") == "forbid", f"{cls.__name__} accepts extra fields"


def test_frozen_nested_containers_are_tuples() -> None:
    """Sequences on frozen models are tuples, so they cannot be mutated in place either."""
    req = request(input=[{"content": "a"}, {"content": "b"}])
    assert isinstance(req.input, tuple)


# --------------------------------------------------------------------------- TurnResult


def test_turn_result_error_requires_error() -> None:
    with pytest.raises(ValidationError, match="error is set exactly when"):
        result(finish_reason="error")


@pytest.mark.parametrize("reason", ["stop", "max_iterations", "cancelled"])
def test_turn_result_error_only_when_failed(reason: str) -> None:
    assert result(finish_reason=reason).error is None
    with pytest.raises(ValidationError, match="error is set exactly when"):
        result(finish_reason=reason, error={"code": "x", "message": "y"})


def test_turn_result_error_with_error() -> None:
    failed = result(finish_reason="error", content=None, error={"code": "x", "message": "y"})
    assert failed.error == TurnError(code="x", message="y")


def test_finish_event_type() -> None:
    assert finish_event_type("error") == "turn.failed"
    assert finish_event_type("cancelled") == "turn.cancelled"
    for reason in ("stop", "max_iterations", "length"):
        assert finish_event_type(reason) == "turn.completed"


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tool_iterations", 0),
        ("max_tool_iterations", 501),
        ("max_tool_iterations", -1),
        ("max_tool_result_chars", 255),
        ("max_tool_result_chars", 1_000_001),
        ("empty_streak_after", -1),
        ("empty_streak_after", 51),
    ],
)
def test_limit_overrides_out_of_bounds(field: str, value: int) -> None:
    with pytest.raises(ValidationError, match=field):
        LimitOverrides.model_validate({field: value})
    with pytest.raises(ValidationError, match=field):
        request(limits={field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tool_iterations", 1),
        ("max_tool_iterations", 50),
        ("max_tool_result_chars", 256),
        ("max_tool_result_chars", 1_000_000),
        ("empty_streak_after", 0),
        ("empty_streak_after", 50),
    ],
)
def test_limit_overrides_within_bounds(field: str, value: int) -> None:
    assert getattr(LimitOverrides.model_validate({field: value}), field) == value


def test_limit_overrides_apply_changes_only_set_fields() -> None:
    limits = LoopLimits(max_tool_iterations=7, max_tool_result_chars=16_000, empty_streak_after=2)
    applied = LimitOverrides(max_tool_iterations=3).apply(limits)
    assert isinstance(applied, LoopLimits)
    assert applied.max_tool_iterations == 3
    assert applied.max_tool_result_chars == 16_000
    assert applied.empty_streak_after == 2
    assert applied.tool_timeout_s == limits.tool_timeout_s
    assert limits.max_tool_iterations == 7, "the agent's limits are not changed"


def test_limit_overrides_apply_all_fields() -> None:
    overrides = LimitOverrides(
        max_tool_iterations=50, max_tool_result_chars=256, empty_streak_after=0
    )
    applied = overrides.apply(LoopLimits())
    assert (applied.max_tool_iterations, applied.max_tool_result_chars) == (50, 256)
    assert applied.empty_streak_after == 0, "0 is a value, not 'unset'"


def test_empty_limit_overrides_keep_the_limits() -> None:
    limits = LoopLimits(max_tool_iterations=9)
    assert LimitOverrides().apply(limits) is limits
    assert request().limits == LimitOverrides()


# --------------------------------------------------------------------------- events


def test_routing_key_example() -> None:
    assert event("tool.invoked", agent="support", turn_id="T1").routing_key == (
        "tool.invoked.support.T1"
    )


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_routing_key_shape(event_type: Any) -> None:
    ev = event(event_type, agent="billing-bot", turn_id="turn_42")
    parts = ev.routing_key.split(".")
    assert len(parts) == 4
    assert f"{parts[0]}.{parts[1]}" == event_type
    assert parts[2:] == ["billing-bot", "turn_42"]


def test_routing_key_without_turn() -> None:
    ev = event("turn.rejected", agent=UNKNOWN, turn_id=None)
    assert ev.routing_key == f"turn.rejected.{UNKNOWN}.{UNKNOWN}"


@pytest.mark.parametrize("agent", ["a.b", "a*", "a#", "{a}", "a b", "a\n", "", "_x", "x" * 129])
def test_event_agent_cannot_break_the_routing_key(agent: str) -> None:
    with pytest.raises(ValidationError, match="agent"):
        event(agent=agent)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_cloudevents_headers(event_type: Any) -> None:
    ev = event(event_type, time=1_700_000_000.25, turn_id="T1")
    headers = ev.headers()
    assert headers["ce-specversion"] == "1.0"
    assert headers["ce-id"] == ev.id
    assert headers["ce-type"] == event_type
    assert headers["ce-source"] == EVENT_SOURCE == "/loopwire/worker"
    assert headers["ce-subject"] == "T1"
    assert all(isinstance(value, str) for value in headers.values())


@pytest.mark.parametrize(
    "time", [0.0, 1.0, 1_700_000_000.0, 1_700_000_000.25, 1_700_000_000.999999]
)
def test_ce_time_is_rfc3339_utc(time: float) -> None:
    ce_time = event(time=time).headers()["ce-time"]
    assert RFC3339_UTC.match(ce_time), ce_time
    assert ce_time.endswith("Z")
    parsed = datetime.fromisoformat(ce_time.replace("Z", "+00:00"))
    assert parsed.tzinfo is not None
    assert parsed.utcoffset() == timedelta(0)
    assert abs(parsed.timestamp() - time) < 1e-5


def test_ce_time_example() -> None:
    assert event(time=0.0).headers()["ce-time"] == "1970-01-01T00:00:00Z"
    assert event(time=1_700_000_000.5).headers()["ce-time"] == "2023-11-14T22:13:20.500000Z"


def test_no_subject_without_turn() -> None:
    assert "ce-subject" not in event("turn.rejected", agent=UNKNOWN, turn_id=None).headers()


def test_event_id_is_deterministic() -> None:
    first = event_id("tool.invoked", "T1", 2, "call_1")
    assert first == event_id("tool.invoked", "T1", 2, "call_1")
    assert uuid.UUID(first).version == 5
    same = event("tool.invoked", turn_id="T1", step=2, call_id="call_1", time=1.0)
    again = event("tool.invoked", turn_id="T1", step=2, call_id="call_1", time=99.0)
    assert same.id == again.id == first, "re-publishing the same occurrence keeps the id"


def test_event_id_is_the_uuid5_earlier_versions_gave() -> None:
    # consumers drop duplicates by id: a step redone by a worker of another version must
    # announce the same id
    assert event_id("tool.invoked", "T1", 2, "call_1") == "4f8b6346-be99-5a68-86d7-a79e332af5e5"
    assert event_id("turn.rejected", None) == "e0589ea4-fbce-5419-9ba3-e0c1c470f16a"
    namespace = uuid.UUID("5d0c0b8e-7a51-4f43-9d1e-6c1f1f0f7a11")
    for turn_id, step, call_id in [("T9", 0, ""), ("t-x", 41, "call_é€😀"), ("a", None, "~!")]:
        key = f"step.completed/{turn_id}/{'' if step is None else step}/{call_id}"
        expected = str(uuid.uuid5(namespace, key))
        assert event_id("step.completed", turn_id, step, call_id) == expected


def test_event_id_differs_per_occurrence() -> None:
    ids = {
        event_id("tool.invoked", "T1", 2, "call_1"),
        event_id("tool.invoked", "T1", 3, "call_1"),  # other step
        event_id("tool.invoked", "T1", 2, "call_2"),  # other call
        event_id("tool.invoking", "T1", 2, "call_1"),  # other type
        event_id("tool.invoked", "T2", 2, "call_1"),  # other turn
        event_id("tool.invoked", "T1", None, "call_1"),  # no step
        event_id("tool.invoked", "T1", 0, "call_1"),  # step 0 is not "no step"
        event_id("tool.invoked", None, 2, "call_1"),  # no turn
    }
    assert len(ids) == 8


def test_make_event_id_suffix_changes_the_id() -> None:
    plain = event("tool.invoking", step=1, call_id="c1")
    retry = event("tool.invoking", step=1, call_id="c1", id_suffix=":2")
    assert plain.id != retry.id


# --------------------------------------------------------------------------- Redis keys


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: between the first ``{`` and the next ``}``."""
    start = key.find("{")
    if start < 0:
        return key
    end = key.find("}", start + 1)
    if end <= start + 1:
        return key
    return key[start + 1 : end]


def session_key_builders() -> dict[str, Any]:
    """Every key builder of ``contracts.keys`` whose first argument is the session id."""
    builders = {}
    for name, func in inspect.getmembers(keys, inspect.isfunction):
        params = list(inspect.signature(func).parameters)
        if params and params[0] == "session_id":
            builders[name] = func
    return builders


def test_session_key_builders_are_found() -> None:
    builders = session_key_builders()
    session_named = {name for name, _ in inspect.getmembers(keys, inspect.isfunction)}
    session_named = {name for name in session_named if name.startswith("session_")}
    assert session_named, "contracts.keys should have session_* keys"
    assert session_named <= set(builders)


@pytest.mark.parametrize("session_id", ["S1", "sess-42_x", "x" * 128])
def test_every_session_key_has_the_session_hash_tag(session_id: str) -> None:
    made = []
    for name, builder in session_key_builders().items():
        extra = ["T1"] * (len(inspect.signature(builder).parameters) - 1)
        key = builder(session_id, *extra)
        assert f"{{{session_id}}}" in key, f"{name} lacks the hash tag: {key}"
        assert hash_tag(key) == session_id, f"{name} hashes on {hash_tag(key)!r}: {key}"
        assert key.startswith(f"{keys.PREFIX}:")
        made.append(key)
    assert len(made) == len(set(made)), "two session keys collide"


def test_tool_call_key_is_tagged_by_its_idempotency_key() -> None:
    key = idempotency_key("T1", "call_1")
    assert key == "T1:call_1"
    assert hash_tag(keys.tool_call(key)) == key


# --------------------------------------------------------------------------- topology


def test_topology_names() -> None:
    assert topology.TURNS_QUEUE == "loopwire.turns"
    assert topology.DEAD_LETTER_QUEUE == "loopwire.turns.dead"
    assert topology.TOOLS_EXCHANGE == "loopwire.tools"
    assert topology.tool_queue("search") == "loopwire.tool.search"
    assert topology.tool_queue("lookup_order-v2") == "loopwire.tool.lookup_order-v2"
    assert topology.EVENTS_EXCHANGE == "loopwire.events"


def test_tool_names_are_safe_in_queue_names() -> None:
    for bad in ("a.b", "a*", "a#", "a b", "", "x" * 65):
        with pytest.raises(ValidationError, match="name"):
            ToolDefinition(name=bad)
    assert ToolDefinition(name="x" * 64).name == "x" * 64


def test_all_names_are_distinct() -> None:
    names = [
        topology.TURNS_QUEUE,
        topology.DEAD_LETTER_EXCHANGE,
        topology.DEAD_LETTER_QUEUE,
        topology.TOOLS_EXCHANGE,
        topology.EVENTS_EXCHANGE,
        topology.RETRY_QUEUE,
    ]
    assert len(names) == len(set(names))
    assert all(name.startswith("loopwire.") for name in names)


def test_contracts_are_equal_when_their_class_and_field_values_are() -> None:
    class Other(Contract):
        prompt_tokens: int = 0
        completion_tokens: int = 0
        total_tokens: int = 0

    class Narrower(Usage):
        pass

    usage = Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
    assert usage == Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
    assert usage != Usage(prompt_tokens=3, completion_tokens=2, total_tokens=4)
    assert usage != Other(prompt_tokens=3, completion_tokens=1, total_tokens=4)
    assert Usage() != Narrower() and Narrower() != Usage()
    assert usage != (3, 1, 4)
    assert hash(usage) == hash(Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4))
    nested = ChatMessage(role="user", content="hi")
    assert (
        nested == ChatMessage(role="user", content="hi") != ChatMessage(role="user", content="ho")
    )


def test_a_copied_contract_is_a_new_frozen_instance_with_the_updates() -> None:
    original = ChatMessage(role="user", content="hi", name="ann")
    copied = original.model_copy(update={"content": "ho"})
    assert copied == ChatMessage(role="user", content="ho", name="ann")
    assert original == ChatMessage(role="user", content="hi", name="ann"), "left as it was"
    assert copied.__dict__ is not original.__dict__
    assert original.model_copy() == original and original.model_copy() is not original
    with pytest.raises(ValidationError):
        copied.content = "changed"  # type: ignore[misc]
    assert copied.model_fields_set == set(), "contracts keep no fields-set, copies neither"
    assert copied.model_dump(exclude_defaults=True) == {
        "role": "user",
        "content": "ho",
        "name": "ann",
    }
    assert hash(copied) == hash(ChatMessage(role="user", content="ho", name="ann"))
    state = AgentState(session_id="s1", agent="support", created_at=1.0, updated_at=1.0)
    deep = state.model_copy(update={"version": 2}, deep=True)
    assert deep.version == 2 and deep.context == state.context and deep.context is not state.context


def test_a_profile_copy_keeps_its_fields_set() -> None:
    profile = AgentProfile(name="support", system_prompt="p")
    assert profile.model_copy(update={"model": "m"}).model_fields_set == {
        "name",
        "system_prompt",
        "model",
    }


# --------------------------------------------------------------------------- pydantic shortcuts


def test_the_shared_fields_set_refuses_every_write() -> None:
    usage = Usage(prompt_tokens=1)
    assert usage.__pydantic_fields_set__ is _NOT_TRACKED
    writes: list[Any] = [
        lambda s: s.add("x"),
        lambda s: s.update({"x"}),
        lambda s: s.discard("x"),
        lambda s: s.remove("x"),
        lambda s: s.pop(),
        lambda s: s.clear(),
        lambda s: s.intersection_update(set()),
        lambda s: s.difference_update({"x"}),
        lambda s: s.symmetric_difference_update({"x"}),
        lambda s: s.__init__(["x"]),
    ]
    for write in writes:
        with pytest.raises(TypeError):
            write(usage.model_fields_set)
    fields_set = usage.model_fields_set
    for operator in ("__ior__", "__iand__", "__isub__", "__ixor__"):
        with pytest.raises(TypeError):
            getattr(fields_set, operator)({"x"})
    with pytest.raises(TypeError):
        BaseModel.model_copy(usage, update={"prompt_tokens": 2})  # pydantic adds "prompt_tokens"
    assert not _NOT_TRACKED and usage.model_fields_set == set()
    for duplicate in (copy.copy, copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))):
        assert duplicate(_NOT_TRACKED) is _NOT_TRACKED
    for duplicate in (copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        assert duplicate(usage).__pydantic_fields_set__ is _NOT_TRACKED


def test_a_write_below_the_set_methods_fails_the_next_construction() -> None:
    usage = Usage(prompt_tokens=1)
    try:
        # pydantic-core adds to the fields-set with C calls, which the set's methods cannot stop
        Usage.__pydantic_validator__.validate_assignment(usage, "prompt_tokens", 2)
        assert list(_NOT_TRACKED) == ["prompt_tokens"]
        with pytest.raises(RuntimeError, match="fields-set was written"):
            Usage()
    finally:
        set.clear(_NOT_TRACKED)
    assert Usage().model_fields_set == set()


def loaded_contract_classes() -> list[type[Contract]]:
    """Every Contract subclass imported so far, the contracts package's included."""
    all_contract_classes()
    found: list[type[Contract]] = []
    pending: list[type[Contract]] = [Contract]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                pending.append(sub)
    return found


def test_contracts_hold_nothing_the_shortcuts_skip() -> None:
    """``Contract.__eq__`` and ``model_copy`` skip pydantic's private attributes, extras,
    generic origins and non-field ``__dict__`` entries: no contract has any of them."""
    classes = loaded_contract_classes()
    assert AgentProfile in classes
    for cls in classes:
        assert not cls.__private_attributes__, cls
        assert cls.model_config.get("extra") == "forbid", cls
        assert cls.__pydantic_generic_metadata__["origin"] is None, cls
        assert not cls.__pydantic_generic_metadata__["parameters"], cls
        cached = [
            name
            for klass in cls.__mro__
            for name, value in vars(klass).items()
            if isinstance(value, functools.cached_property)
        ]
        assert not cached, (cls, cached)


class SameFields(Contract):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class NarrowerUsage(Usage):
    pass


def state_with_context() -> AgentState:
    return AgentState(
        session_id="S1",
        agent="support",
        created_at=1.0,
        updated_at=2.0,
        context=SessionContext(kv={"cart": {"items": [1, 2]}}),
    )


def equality_pairs() -> list[tuple[Any, Any]]:
    usage = Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
    state = state_with_context()
    profile = AgentProfile(name="support")
    return [
        (usage, usage),
        (usage, Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)),
        (usage, Usage(prompt_tokens=3, completion_tokens=2, total_tokens=4)),
        (usage, SameFields(prompt_tokens=3, completion_tokens=1, total_tokens=4)),
        (Usage(), NarrowerUsage()),
        (NarrowerUsage(), Usage()),
        (usage, (3, 1, 4)),
        (usage, usage.model_copy()),
        (state, state.model_copy(update={"version": 2})),
        (state, state.model_copy(deep=True)),
        (state, state_with_context()),
        (request(), request()),
        (request(), request(metadata={"k": 1})),
        (ChatMessage.user("hi"), ChatMessage(role="user", content="hi")),
        (profile, AgentProfile(name="support", tools=("*",))),  # other fields-set, same values
        (profile, AgentProfile(name="support", model="m")),
    ]


def test_contracts_compare_as_pydantic_does() -> None:
    for left, right in equality_pairs():
        assert left.__eq__(right) is BaseModel.__eq__(left, right), (left, right)
        assert (left == right) is (BaseModel.__eq__(left, right) is True), (left, right)


def pydantic_copy(model: BaseModel, update: dict[str, Any] | None, deep: bool) -> BaseModel:
    """pydantic's own ``model_copy`` of ``model``, on a twin that has a fields-set of its own."""
    if model.__pydantic_fields_set__ is not _NOT_TRACKED:
        return BaseModel.model_copy(model, update=update, deep=deep)
    twin = BaseModel.__copy__(model)
    object.__setattr__(twin, "__pydantic_fields_set__", set())
    return BaseModel.model_copy(twin, update=update, deep=deep)


COPIES: dict[str, tuple[Any, dict[str, Any] | None, bool]] = {
    "plain": (Usage(prompt_tokens=3), None, False),
    "update": (ChatMessage.user("hi").model_copy(update={"name": "ann"}), {"content": "ho"}, False),
    "nested update": (state_with_context(), {"version": 2, "context": SessionContext()}, False),
    "deep": (state_with_context(), None, True),
    "deep update": (
        state_with_context(),
        {"version": 2, "context": SessionContext(kv={"k": [1]})},
        True,
    ),
    "tuples": (request(input=[{"content": "a"}, {"content": "b"}]), {"persist": False}, False),
    "profile": (AgentProfile(name="support", system_prompt="p"), {"model": "m"}, False),
    "deep profile": (AgentProfile(name="support", system_prompt="p"), {"model": "m"}, True),
}


@pytest.mark.parametrize(("model", "update", "deep"), COPIES.values(), ids=COPIES.keys())
def test_contracts_copy_as_pydantic_does(model: Any, update: Any, deep: bool) -> None:
    ours = model.model_copy(update=update, deep=deep)
    theirs = pydantic_copy(model, update, deep)
    assert type(ours) is type(theirs) is type(model)
    assert ours.__dict__ == theirs.__dict__ and ours.__dict__ is not model.__dict__
    assert BaseModel.__eq__(ours, theirs) is True
    assert ours.__pydantic_extra__ == theirs.__pydantic_extra__
    assert ours.__pydantic_private__ == theirs.__pydantic_private__
    assert ours.model_dump() == theirs.model_dump()
    assert ours.model_dump_json() == theirs.model_dump_json()
    for name, value in model.__dict__.items():
        shared, shared_by_pydantic = ours.__dict__[name] is value, theirs.__dict__[name] is value
        assert shared is shared_by_pydantic, (
            f"{name}: shared {shared}, by pydantic {shared_by_pydantic}"
        )
    for name, value in (update or {}).items():
        assert ours.__dict__[name] is value is theirs.__dict__[name], "updates are not copied"
    with pytest.raises(ValidationError, match="frozen"):
        setattr(ours, next(iter(type(ours).model_fields)), None)
    if model.__pydantic_fields_set__ is _NOT_TRACKED:
        # the one difference: pydantic adds the updated names, a contract keeps no fields-set
        assert ours.__pydantic_fields_set__ is _NOT_TRACKED
        assert ours.model_dump(exclude_unset=True) == model.model_dump(exclude_unset=True) == {}
        assert theirs.model_fields_set == set(update or ())
    else:
        assert ours.model_fields_set == theirs.model_fields_set
        assert ours.model_fields_set == model.model_fields_set | set(update or ())
        assert ours.model_dump(exclude_unset=True) == theirs.model_dump(exclude_unset=True)
        assert ours.__pydantic_fields_set__ is not model.__pydantic_fields_set__


def test_fields_added_to_v1_messages_are_written_only_when_set() -> None:
    """A peer of an earlier version (which refuses unknown fields) reads what this one writes
    unless the new feature is used."""
    plain = decode_obj(encode(request()))
    assert "budget" not in plain
    assert "budget" in decode_obj(encode(request(budget=Budget(max_tool_calls=3))))
    assert "cost_usd" not in decode_obj(encode(result()))
    assert decode_obj(encode(result(cost_usd=0.5)))["cost_usd"] == 0.5
    step = StepWork(session_id="s", turn_id="t", step=1)
    assert set(decode_obj(encode(step))) == {"schema_version", "session_id", "turn_id", "step"}
