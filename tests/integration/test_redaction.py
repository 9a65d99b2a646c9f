"""The ``redact`` hook set through live workers: real RabbitMQ and Redis, worker subprocesses,
the scripted model over HTTP, counting tool services.

Every test makes its own canaries (a random e-mail, IBAN, card number, phone number, customer
id and configured literal) and checks that no request the model received, no event and no
worker log line carries one, while the tool services receive the real values."""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from contracts import keys
from contracts.client import LoopwireClient, TurnHandle
from contracts.events import Event, ToolInvoked
from contracts.tools import ToolCallRequest
from contracts.turns import TurnResult
from harness import (
    REDIS_URL,
    SURVIVOR_ENV,
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    session_history,
)
from worker.redaction.checks import iban_valid, luhn_valid
from worker.redaction.vault import RedisVault
from worker.session.store import RedisStore
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Canaries:
    email: str
    iban: str
    card: str
    phone: str
    customer: str
    codename: str

    @classmethod
    def new(cls) -> Canaries:
        tag = secrets.token_hex(5)
        digits = "".join(secrets.choice("0123456789") for _ in range(40))
        bban = digits[:18]
        check = next(f"{n:02d}" for n in range(2, 99) if iban_valid(f"DE{n:02d}{bban}"))
        iban = f"DE{check}{bban}"
        card = next(c for d in "0123456789" if luhn_valid(c := f"4{digits[18:32]}{d}"))
        return cls(
            email=f"c.{tag}@canary-{tag}.example",
            iban=" ".join(iban[i : i + 4] for i in range(0, len(iban), 4)),
            card=" ".join(card[i : i + 4] for i in range(0, 16, 4)),
            phone=f"+49 30 {int(digits[32:39]) % 9_000_000 + 1_000_000}",
            customer=f"CUST-{digits[30:38]}",
            codename=f"Nightjar {tag}",
        )

    def forms(self) -> list[str]:
        """Every way a canary could leak: as written and without its spaces."""
        written = [self.email, self.iban, self.card, self.phone, self.customer, self.codename]
        return written + [v.replace(" ", "") for v in (self.iban, self.card, self.phone)]

    def user_text(self) -> str:
        return (
            f"I am {self.email}, IBAN {self.iban}, card {self.card}, phone {self.phone}, "
            f"customer {self.customer}, about {self.codename}."
        )


def leaks(text: str, *canaries: Canaries) -> list[str]:
    return [form for c in canaries for form in c.forms() if form in text]


def event_text(events: list[Event]) -> str:
    return "\n".join(e.model_dump_json() for e in events)


def write_agents(path: Path, tools: list[str], *canaries: Canaries) -> Path:
    agent = {
        "name": "support",
        "system_prompt": "You are a support agent.",
        "tools": tools,
        "hooks": ["redact"],
        "redaction": {
            "patterns": {"CUSTOMER_ID": r"CUST-\d{8}"},
            "literals": {"CODENAME": [c.codename for c in canaries]},
        },
    }
    path.write_text(json.dumps({"agents": [agent]}))
    return path


@pytest.fixture
async def sessions() -> AsyncIterator[list[str]]:
    """Session ids of the test; their Redis keys (the redaction map included) go at teardown."""
    ids: list[str] = []
    yield ids
    redis = Redis.from_url(REDIS_URL)
    try:
        for session in ids:
            async for key in redis.scan_iter(match=f"lw:{{{session}}}:*"):
                await redis.delete(key)
    finally:
        await redis.aclose()


def new_session(sessions: list[str]) -> str:
    session = f"red-{uuid.uuid4().hex[:12]}"
    sessions.append(session)
    return session


async def next_reply(handle: TurnHandle) -> TurnResult:
    """The next direct reply on the handle's queue (the first one was taken by ``result``)."""
    seen = 0
    while True:
        item = await handle._events.get()
        if isinstance(item, TurnResult):
            seen += 1
            if seen == 2:
                return item


async def tool(name: str, body: Any) -> CountingToolService:
    service = CountingToolService(f"{name}_{uuid.uuid4().hex[:8]}", body)
    await service.start()
    return service


async def test_canaries_never_reach_the_model_events_or_logs(
    topology: None,
    scripted_model: ScriptedModel,
    events: EventRecorder,
    client: LoopwireClient,
    sessions: list[str],
    tmp_path: Path,
) -> None:
    c = Canaries.new()

    async def crm_body(request: ToolCallRequest) -> object:
        return {
            "results": [
                {
                    "email": c.email.upper(),
                    "iban": c.iban.replace(" ", ""),
                    "note": f"{c.codename}: call {c.phone}, card {c.card}",
                }
            ]
        }

    async def mail_body(request: ToolCallRequest) -> object:
        raise RuntimeError(f"mailbox {request.arguments['to']} is full")

    crm, mailer = await tool("crm", crm_body), await tool("mailer", mail_body)
    customer = {
        "email": "«EMAIL_1»",
        "payment": {"iban": "«IBAN_1»", "cards": ["«CARD_1»"]},
        "contact": [{"phone": "call «PHONE_1» after 5"}],
        "id": "«CUSTOMER_ID_1»",
        "project": "«CODENAME_1»",
    }
    scripted_model.expect(
        Reply.tool_calls(
            (crm.name, {"customer": customer}),
            (mailer.name, {"to": "«EMAIL_1»", "cc": "«EMAIL_7»"}),
        )
    )
    scripted_model.expect(Reply.text("Sent «CODENAME_1» details to «EMAIL_1» (card «CARD_1»)."))
    session = new_session(sessions)
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=write_agents(tmp_path / "agents.json", [crm.name, mailer.name], c),
    )
    await worker.start()
    try:
        handle = await client.start_turn("support", c.user_text(), session_id=session)
        result = await handle.result(30)
        await client.publish(handle.request)  # a duplicate is answered from the stored result
        duplicate = await asyncio.wait_for(next_reply(handle), 15)
        await handle.close()
        await events.wait_for(
            lambda evs: any(e.type == "turn.completed" and e.session_id == session for e in evs)
        )
    finally:
        worker.close()
        await crm.stop()
        await mailer.stop()

    # The publisher gets the real values back, also when it asks twice.
    assert result.content == f"Sent {c.codename} details to {c.email} (card {c.card})."
    assert duplicate.content == result.content
    # The tool services get the real values, however deep.
    assert crm.received[0].arguments == {
        "customer": {
            "email": c.email,
            "payment": {"iban": c.iban, "cards": [c.card]},
            "contact": [{"phone": f"call {c.phone} after 5"}],
            "id": c.customer,
            "project": c.codename,
        }
    }
    assert mailer.received[0].arguments == {"to": c.email, "cc": "«EMAIL_7»"}
    # The model never sees one, not even in the tool results it reads back.
    assert leaks(json.dumps(scripted_model.requests, ensure_ascii=False), c) == []
    results = [m["content"] for m in scripted_model.requests[1]["messages"] if m["role"] == "tool"]
    assert json.loads(results[0]) == {
        "results": [
            {
                "email": "«EMAIL_1»",
                "iban": "«IBAN_1»",
                "note": "«CODENAME_1»: call «PHONE_1», card «CARD_1»",
            }
        ]
    }
    assert "mailbox «EMAIL_1» is full" in results[1]
    # No event and no log line carries one; the events keep the placeholders.
    turn_events = [e for e in events.events if e.session_id == session]
    assert leaks(event_text(turn_events), c) == []
    invoked = {e.data.tool: e.data for e in turn_events if isinstance(e.data, ToolInvoked)}
    assert "mailbox «EMAIL_1» is full" in (invoked[mailer.name].error or "")
    assert invoked[mailer.name].unresolved_placeholders == ("«EMAIL_7»",)
    assert invoked[crm.name].unresolved_placeholders == ()
    completed = next(e for e in turn_events if e.type == "turn.completed")
    assert "«EMAIL_1»" in completed.model_dump_json()
    log = worker.log_path.read_text(errors="replace")
    assert leaks(log, c) == []
    assert "«EMAIL_7»" in log  # the operator is told what could not be restored
    assert worker.errors() == []
    # The stored result keeps the placeholders; the history keeps the user's words as sent
    # and no tool output in the clear.
    redis = Redis.from_url(REDIS_URL)
    try:
        stored = await RedisStore(redis).result(session, result.turn_id)
    finally:
        await redis.aclose()
    assert stored is not None
    assert stored.content == "Sent «CODENAME_1» details to «EMAIL_1» (card «CARD_1»)."
    history = await session_history(session)
    assert [m.role for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
    assert history[0].content == c.user_text()
    assert leaks(json.dumps([m.model_dump() for m in history[1:]], ensure_ascii=False), c) == []


async def test_two_sessions_have_independent_mappings(
    topology: None,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    sessions: list[str],
    tmp_path: Path,
) -> None:
    a, b1, b2 = Canaries.new(), Canaries.new(), Canaries.new()
    session_a, session_b = new_session(sessions), new_session(sessions)
    # Session B has two e-mail addresses: «EMAIL_1» and «EMAIL_2».
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "«EMAIL_2»"})))
    scripted_model.expect(Reply.text("B: «EMAIL_1»"))
    # Session A has one: its «EMAIL_1» is A's value and «EMAIL_2» is nobody's.
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "«EMAIL_1»", "cc": "«EMAIL_2»"})))
    scripted_model.expect(Reply.text("A: «EMAIL_1» «EMAIL_2»"))
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=write_agents(tmp_path / "agents.json", [lookup.name], a, b1, b2),
    )
    await worker.start()
    try:
        result_b = await client.run_turn(
            "support", f"me: {b1.email}, my wife: {b2.email}", session_id=session_b, timeout=30
        )
        b_requests = len(scripted_model.requests)
        result_a = await client.run_turn(
            "support", f"me: {a.email}", session_id=session_a, timeout=30
        )
    finally:
        worker.close()

    assert result_b.content == f"B: {b1.email}"
    assert result_a.content == f"A: {a.email} «EMAIL_2»"  # B's «EMAIL_2» means nothing in A
    assert lookup.received[0].arguments == {"q": b2.email}
    assert lookup.received[1].arguments == {"q": a.email, "cc": "«EMAIL_2»"}
    b_seen = json.dumps(scripted_model.requests[:b_requests], ensure_ascii=False)
    a_seen = json.dumps(scripted_model.requests[b_requests:], ensure_ascii=False)
    assert leaks(b_seen, a, b1, b2) == []
    assert leaks(a_seen, a, b1, b2) == []
    assert "found «EMAIL_2»" in b_seen and "found «EMAIL_1»" in a_seen
    assert leaks(worker.log_path.read_text(errors="replace"), a, b1, b2) == []
    assert worker.errors() == []


async def test_worker_killed_after_the_model_answered_restores_on_another(
    topology: None,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    sessions: list[str],
    tmp_path: Path,
) -> None:
    c = Canaries.new()
    arguments = {"q": "«EMAIL_1»", "payment": {"cards": ["«CARD_1»"], "iban": "«IBAN_1»"}}
    scripted_model.expect(Reply.tool_calls((lookup.name, arguments)))
    scripted_model.expect(Reply.text("Checked «EMAIL_1»."))
    agents = write_agents(tmp_path / "agents.json", [lookup.name], c)
    doomed = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={"LOOPWIRE_FAILPOINTS": "model_saved"},
    )
    survivor = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, extra_env=SURVIVOR_ENV
    )
    session = new_session(sessions)
    await doomed.start()
    try:
        handle = await client.start_turn("support", c.user_text(), session_id=session)
        assert await doomed.exited() == 137, "the worker did not reach its failpoint"
        assert lookup.received == []
        await survivor.start()
        result = await handle.result(30)
        await handle.close()
    finally:
        doomed.close()
        survivor.close()

    assert result.content == f"Checked {c.email}."
    assert len(scripted_model.requests) == 2, "a saved model response was requested again"
    assert [r.arguments for r in lookup.received] == [
        {"q": c.email, "payment": {"cards": [c.card], "iban": c.iban}}
    ]
    assert leaks(json.dumps(scripted_model.requests, ensure_ascii=False), c) == []
    for worker in (doomed, survivor):
        assert leaks(worker.log_path.read_text(errors="replace"), c) == []
    assert survivor.errors() == []


async def test_concurrent_redactions_of_one_value_get_one_placeholder(
    sessions: list[str],
) -> None:
    session = new_session(sessions)
    clients = [Redis.from_url(REDIS_URL) for _ in range(4)]
    try:
        vaults = [RedisVault(r) for r in clients]
        values = [f"v{i}@example.org" for i in range(5)]

        async def redact(i: int) -> list[str]:
            items = [("EMAIL", v, v) for v in values[i % 5 :] + values[: i % 5]]
            placeholders = await vaults[i % 4].assign(session, items, 600)
            return [p for _, p in sorted(zip([v for _, v, _ in items], placeholders, strict=True))]

        outcomes = await asyncio.gather(*(redact(i) for i in range(40)))
        assert all(outcome == outcomes[0] for outcome in outcomes)
        assert sorted(outcomes[0]) == [f"«EMAIL_{n}»" for n in range(1, 6)]
        resolved = await vaults[0].resolve(session, outcomes[0])
        assert sorted(resolved.values()) == sorted(values)
        ttl = await clients[0].ttl(keys.redaction_map(session))
        assert 0 < ttl <= 600
        assert await vaults[1].resolve(new_session(sessions), outcomes[0]) == {}
    finally:
        for r in clients:
            await r.aclose()


async def test_a_retried_model_request_is_built_again_the_same_and_redacted(
    topology: None,
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    sessions: list[str],
    tmp_path: Path,
) -> None:
    """The worker does not keep the request body while the model thinks: the client's retry
    gets it built again from the session history and the redaction map."""
    c = Canaries.new()
    scripted_model.expect(Reply.text("Noted, «EMAIL_1»."))
    scripted_model.expect(Reply.error(503, "overloaded", headers={"retry-after-ms": "1"}))
    scripted_model.expect(Reply.text("Still noted, «EMAIL_1» and «IBAN_1»."))
    session = new_session(sessions)
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=write_agents(tmp_path / "agents.json", [], c),
        extra_env={"LOOPWIRE_MODEL__MAX_RETRIES": "2"},
    )
    await worker.start()
    try:
        first = await client.run_turn("support", c.user_text(), session_id=session, timeout=30)
        second = await client.run_turn(
            "support", f"And my IBAN is {c.iban}.", session_id=session, timeout=30
        )
    finally:
        worker.close()

    assert first.content == f"Noted, {c.email}."
    assert second.content == f"Still noted, {c.email} and {c.iban}."
    first_request, failed, retried = scripted_model.requests
    assert retried == failed
    assert len(retried["messages"]) == len(first_request["messages"]) + 2
    assert leaks(json.dumps(scripted_model.requests, ensure_ascii=False), c) == []
    assert worker.errors() == []
