"""Two tenants on one fleet, each publishing as a RabbitMQ user of its own (created here, in
the suites' vhost): the same session id is two sessions; one tenant cannot read, cancel,
decide, delete or subscribe to the other's turns; a publisher naming another tenant, or
saying nothing of who it is, is dead-lettered and never runs (docs/tenants.md)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import aiohttp
import pytest
from aiormq.exceptions import ChannelAccessRefused, ChannelClosed
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from support_rpc import AMQP_URL, REDIS_URL, wait_until
from tenant_support import tenant_worker

from contracts import tenancy
from contracts import topology as t
from contracts.client import LoopwireClient
from contracts.codec import decode, encode
from contracts.turns import InputMessage, TurnRejection, TurnRequest
from harness import ROOT, CountingToolService, WorkerProcess, run_cli, subscribed
from worker.testing.scripted_model import Reply, ScriptedModel
from worker.transport.topology import TURNS_ARGUMENTS

pytestmark = pytest.mark.integration


@pytest.fixture
async def clients(tenant_users: dict[str, str], topology: None) -> AsyncIterator[dict[str, Any]]:
    async with (
        LoopwireClient(tenant_users["acme"], tenant="acme") as acme,
        LoopwireClient(tenant_users["globex"], tenant="globex") as globex,
    ):
        yield {"acme": acme, "globex": globex}


@pytest.fixture
async def cleanup(redis: Redis, uid: str) -> AsyncIterator[None]:
    """The keys of the tenants' sessions (outside the suite's usual patterns)."""
    yield
    for tenant in ("acme", "globex"):
        for pattern in (f"lw:{{{tenant}/s-{uid}*", f"lw:turn:{tenant}/t-{uid}*"):
            async for key in redis.scan_iter(match=pattern):
                await redis.delete(key)


async def samples(process: WorkerProcess, name: str) -> list[tuple[dict[str, str], float]]:
    """The worker's samples of the metric ``name``: labels and value."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{process.port}/metrics") as response,
    ):
        text = await response.text()
    return sorted(
        (
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ),
        key=str,
    )


async def turns_started(process: WorkerProcess) -> list[tuple[dict[str, str], float]]:
    """The worker's ``loopwire_turns_started_total`` samples: labels and value."""
    return await samples(process, "loopwire_turns_started_total")


def contents(request: dict[str, Any]) -> list[str]:
    return [str(m.get("content")) for m in request["messages"]]


async def test_one_session_id_is_two_sessions_and_neither_tenant_reaches_the_other(
    scripted_model: ScriptedModel,
    clients: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    tmp_path: Path,
    uid: str,
    cleanup: None,
) -> None:
    acme, globex = clients["acme"], clients["globex"]
    session = f"s-{uid}"
    scripted_model.expect(Reply.text("hello acme"))
    scripted_model.expect(Reply.text("hello globex"))
    # the metrics labelled by tenant, one tenant named: the rest are "other"
    labelled = {
        "LOOPWIRE_TENANTS__METRICS_LABEL": "true",
        "LOOPWIRE_TENANTS__METRICS_MAX_TENANTS": "1",
    }
    async with tenant_worker(scripted_model, tenant_users, tmp_path, **labelled) as process:
        first = await acme.run_turn(
            "support", "I am acme", session_id=session, turn_id=f"t-{uid}-a"
        )
        second = await globex.run_turn(
            "support", "I am globex", session_id=session, turn_id=f"t-{uid}-b"
        )
        assert (first.content, second.content) == ("hello acme", "hello globex")
        assert await turns_started(process) == [
            ({"agent": "support", "tenant": "acme"}, 1.0),
            ({"agent": "support", "tenant": "other"}, 1.0),
        ]
        # the model saw each tenant's conversation alone
        assert "I am acme" not in contents(scripted_model.requests[1])
        assert "I am globex" in contents(scripted_model.requests[1])

        # globex reads its own session, and acme's turn is not found from there
        history, total = await globex.sessions.history(session)
        assert [m.content for m in history] == ["I am globex", "hello globex"] and total == 2
        assert await globex.sessions.result(f"t-{uid}-a", session) is None
        assert await globex.sessions.result(f"t-{uid}-a") is None
        assert await globex.sessions.turn(f"t-{uid}-a") is None
        # each attempt counted as globex's ("other": the label names one tenant)
        not_found = [
            (labels["op"], value)
            for labels, value in await samples(process, "loopwire_session_reads_total")
            if labels["result"] == "not_found" and labels["tenant"] == "other"
        ]
        assert sorted(not_found) == [("result", 2.0), ("turn", 1.0)], not_found
        # deleting "its" session deletes globex's only
        await globex.sessions.delete(session)
        assert await globex.sessions.get(session) is None
        history, total = await acme.sessions.history(session)
        assert [m.content for m in history] == ["I am acme", "hello acme"] and total == 2
        assert (await acme.sessions.result(f"t-{uid}-a", session)) is not None
        assert process.errors() == []


async def test_a_parked_turn_is_decided_and_cancelled_by_its_own_tenant_only(
    scripted_model: ScriptedModel,
    clients: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    tmp_path: Path,
    uid: str,
    cleanup: None,
) -> None:
    acme, globex = clients["acme"], clients["globex"]

    async def refund(request: Any) -> object:
        return {"refunded": True}

    tool = CountingToolService(f"refund_{uid}", refund)
    await tool.start()
    agent = {"name": "support", "tools": [tool.name], "approval": [tool.name]}
    scripted_model.expect(Reply.tool_calls((tool.name, {}, "c_refund")))
    try:
        async with tenant_worker(scripted_model, tenant_users, tmp_path, agent) as process:
            handle = await acme.start_turn("support", "refund me", session_id=f"s-{uid}")
            requested = await asyncio.wait_for(anext(handle.approvals()), 20)
            assert requested.data.call_id == "c_refund"  # type: ignore[union-attr]
            # globex names acme's turn: as if there were no such turn
            await globex.decide(handle.turn_id, "c_refund", "approve")
            await globex.cancel(handle.turn_id, "not yours")
            await globex.cancel(handle.turn_id, "not yours", session_id=f"s-{uid}")
            info = await acme.sessions.turn(handle.turn_id)
            assert info is not None and info.status == "waiting", info
            assert tool.executions == {}

            async def counted() -> bool:  # each of globex's attempts, as a turn unknown to it
                found = await samples(process, "loopwire_work_dropped_total")
                return ({"reason": "unknown_turn"}, 3.0) in found

            await wait_until(counted)
            # acme's own cancel ends it
            await acme.cancel(handle.turn_id, "changed my mind")
            result = await handle.result(20)
            await handle.close()
            assert result.finish_reason == "cancelled"
            assert tool.executions == {}
            assert process.errors() == []
    finally:
        await tool.stop()


async def test_claiming_another_tenant_or_no_one_is_dead_lettered_and_never_runs(
    scripted_model: ScriptedModel,
    tenant_users: dict[str, str],
    topology: None,
    tmp_path: Path,
    uid: str,
) -> None:
    async with tenant_worker(scripted_model, tenant_users, tmp_path) as process:
        connection = await aio_pika.connect(tenant_users["acme"])
        async with connection:  # as a publisher may: its own reply queue, loopwire.requests
            channel = await connection.channel()
            replies = await channel.declare_queue(f"loopwire-client.{uid}", exclusive=True)
            requests = await channel.get_exchange(t.REQUESTS_EXCHANGE, ensure=False)
            acme_user = tenant_users["acme"].split("//")[1].split(":")[0]

            def request(name: str) -> bytes:
                return encode(
                    TurnRequest(
                        turn_id=f"t-{uid}-{name}",
                        session_id=f"s-{uid}",
                        agent="support",
                        input=(InputMessage(content="hi"),),
                        reply_to=replies.name,
                    )
                )

            for name, user_id, headers in (
                ("liar", acme_user, {tenancy.H_TENANT: "globex"}),  # acme's user naming globex
                ("anon", None, {}),  # no user_id: nothing vouches for its tenant
            ):
                await requests.publish(
                    aio_pika.Message(
                        request(name),
                        headers={t.H_KIND: t.KIND_START, **headers},
                        user_id=user_id,
                    ),
                    routing_key=t.TURNS_QUEUE,
                )
            # the broker holds acme's user to its own intake key (topic permissions)
            trespass = await connection.channel()
            intake = await trespass.get_exchange(t.INTAKE_EXCHANGE, ensure=False)
            with pytest.raises((ChannelAccessRefused, ChannelClosed)):
                await intake.publish(aio_pika.Message(b"x", user_id=acme_user), "globex.turns")
            operator = await aio_pika.connect(AMQP_URL)  # no topic permission holds this user
            async with operator:
                intake = await (await operator.channel()).get_exchange(
                    t.INTAKE_EXCHANGE, ensure=False
                )
                operator_user = urlsplit(AMQP_URL).username
                await intake.publish(
                    aio_pika.Message(
                        request("stray"), headers={t.H_KIND: t.KIND_START}, user_id=operator_user
                    ),
                    routing_key=t.intake_key("globex"),  # in globex's intake, not its tenant
                )
            rejections = []
            async with replies.iterator() as messages:
                async for message in messages:
                    await message.ack()
                    rejections.append(decode(message.body, TurnRejection))
                    if len(rejections) == 3:
                        break
        connection = await aio_pika.connect(AMQP_URL)  # an operator reads the dead letters
        async with connection:
            channel = await connection.channel()
            dead = await channel.declare_queue(t.DEAD_LETTER_QUEUE, passive=True)
            letters: dict[str, str] = {}
            while (message := await dead.get(no_ack=True, fail=False)) is not None:
                headers = message.headers or {}
                letters[str(message.message_id)] = (
                    f"{headers.get(t.H_REASON_CODE)}: {headers.get(t.H_REASON)}"
                )
        assert process.errors() == []
    by_turn = {r.turn_id: r for r in rejections}
    assert {r.code for r in rejections} == {"tenant_mismatch"}
    assert "acts for tenant 'acme' only, not 'globex'" in by_turn[f"t-{uid}-liar"].reason
    assert "no user_id" in by_turn[f"t-{uid}-anon"].reason
    assert f"of tenant {operator_user!r} in the intake of tenant 'globex'" in (
        by_turn[f"t-{uid}-stray"].reason
    )
    assert sorted(letters.values()) == sorted(
        f"tenant_mismatch: {by_turn[f't-{uid}-{name}'].reason}"
        for name in ("anon", "liar", "stray")
    ), letters
    # the model was never asked (the fixture fails on any unexpected call)


async def test_a_tenant_follows_its_own_events_and_the_broker_refuses_the_others(
    scripted_model: ScriptedModel,
    clients: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    tmp_path: Path,
    uid: str,
    cleanup: None,
) -> None:
    acme = clients["acme"]
    # globex's user may not bind to acme's events (topic permissions)
    connection = await aio_pika.connect(tenant_users["globex"])
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"loopwire-client.{uid}", exclusive=True)
        with pytest.raises(ChannelAccessRefused):
            await queue.bind(t.EVENTS_EXCHANGE, routing_key="acme.#")
    scripted_model.expect(Reply.text("hello"))
    async with tenant_worker(scripted_model, tenant_users, tmp_path):
        handle = await acme.start_turn("support", "hi", session_id=f"s-{uid}")
        types = [event.type async for event in handle.events()]
        await handle.close()
    assert types[0] == "turn.accepted" and types[-1] == "turn.completed", types


def cli_env(amqp_url: str, **more: str) -> dict[str, str]:
    """The command's environment: the broker as ``amqp_url``'s user, the suite's Redis."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWIRE_")}
    return {**base, "LOOPWIRE_AMQP_URL": amqp_url, "LOOPWIRE_REDIS_URL": REDIS_URL, **more}


async def test_the_cli_acts_within_its_tenant(
    scripted_model: ScriptedModel,
    tenant_users: dict[str, str],
    topology: None,
    redis: Redis,
    tmp_path: Path,
    uid: str,
    cleanup: None,
) -> None:
    """``loopwire --tenant acme ...`` as acme's user: its turn runs, and what it reads and
    follows (a session, the approvals, the events) is acme's; the default tenant's session of
    the same id, parked on an approval, stays out of sight."""

    async def refund(request: Any) -> object:
        return {"refunded": True}

    tool = CountingToolService(f"refund_{uid}", refund)
    await tool.start()
    agent = {"name": "support", "tools": [tool.name], "approval": [tool.name]}
    session = f"s-{uid}"
    acme = cli_env(tenant_users["acme"])
    made: list[str] = []  # keys of the turn the command named (not t-<uid>...)
    scripted_model.expect(Reply.tool_calls((tool.name, {}, "c_refund")))  # the default's turn
    scripted_model.expect(Reply.text("hello acme"))
    try:
        async with (
            tenant_worker(scripted_model, tenant_users, tmp_path, agent) as process,
            LoopwireClient(AMQP_URL, tenant=tenancy.DEFAULT) as default,
        ):
            # acme's tail, bound before anything runs (within acme's events: acme.#)
            tail = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "worker.cli", "tail", "--json", "--tenant", "acme",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=acme,
                cwd=ROOT,
            )  # fmt: skip
            await subscribed("acme.#", 0)
            # the default tenant's turn in a session of the same id waits for a decision
            parked = await default.start_turn(
                "support", "I am the default", session_id=session, turn_id=f"t-{uid}-d"
            )
            await asyncio.wait_for(anext(parked.approvals()), 20)

            ran = await run_cli(
                "--tenant", "acme", "turn", "I am acme", "--agent", "support",
                "--session", session, "--follow", "--json", env=acme,
            )  # fmt: skip
            assert ran.returncode == 0, ran.stderr
            lines = [json.loads(line) for line in ran.stdout.splitlines()]
            assert lines[-1]["result"]["content"] == "hello acme"
            turn_id = lines[-1]["result"]["turn_id"]
            made.append(f"lw:turn:acme/{turn_id}:session")
            types = [line["type"] for line in lines[:-1]]  # its progress, bound within acme.
            assert (types[0], types[-1]) == ("turn.accepted", "turn.completed"), types
            # the tail heard acme's turn, and nothing of the default tenant's
            heard: list[dict[str, Any]] = []
            assert tail.stdout is not None
            while not heard or heard[-1]["type"] != "turn.completed":
                heard.append(json.loads(await asyncio.wait_for(tail.stdout.readline(), 20)))
            tail.terminate()
            await tail.wait()
            assert {event["turn_id"] for event in heard} == {turn_id}, heard

            shown = await run_cli("session", "show", session, "--tenant", "acme", env=acme)
            assert shown.returncode == 0, shown.stderr
            assert shown.stdout.splitlines()[0].startswith(
                f"session {session} (agent support): 1 turn(s) done, 2 message(s)"
            )
            assert "parked" not in shown.stdout and f"t-{uid}-d" not in shown.stdout
            # the tenant named by LOOPWIRE_TENANT, as the other settings are
            history = await run_cli(
                "session", "history", session, env={**acme, "LOOPWIRE_TENANT": "acme"}
            )
            assert history.returncode == 0, history.stderr
            assert "I am acme" in history.stdout and "I am the default" not in history.stdout
            result = await run_cli("--tenant", "acme", "result", turn_id, env=acme)
            assert (result.returncode, result.stdout) == (0, "hello acme\n"), result.stderr

            # a trusted user (the worker's, here) reads the session of the tenant it names
            guest = cli_env(AMQP_URL)
            for tenant, seen in (("acme", "1 turn(s) done"), (tenancy.DEFAULT, "  parked: ")):
                shown = await run_cli("session", "show", session, "--tenant", tenant, env=guest)
                assert shown.returncode == 0 and seen in shown.stdout, (tenant, shown)

            # the approvals: acme has none; the default tenant's call is listed for it alone
            waiting = await run_cli("--tenant", "acme", "approvals", env=acme)
            assert waiting.returncode == 0, waiting.stderr
            assert waiting.stdout == "no tool call waits for a decision\n"
            for env in (guest, {**guest, "LOOPWIRE_TENANT": tenancy.DEFAULT}):
                listed = await run_cli("approvals", env=env)
                assert listed.returncode == 0, listed.stderr
                assert f"t-{uid}-d c_refund support/{tool.name}" in listed.stdout

            # acme's controls name the default tenant's turn: there is no such turn for acme
            for args in (("cancel", f"t-{uid}-d"), ("approve", f"t-{uid}-d", "c_refund")):
                refused = await run_cli("--tenant", "acme", *args, env=acme)
                assert refused.returncode == 5, refused.stderr
                assert refused.stderr.startswith(f"error: no turn t-{uid}-d: no worker has")
            assert tool.executions == {}
            # the default tenant's own cancel, from the command line as a trusted user
            cancelled = await run_cli(
                "cancel", f"t-{uid}-d", "--tenant", tenancy.DEFAULT, env=guest
            )
            assert cancelled.returncode == 0, cancelled.stderr
            assert (await parked.result(20)).finish_reason == "cancelled"
            await parked.close()
            # the metrics not asked to carry the tenant: the series they always had
            assert await turns_started(process) == [({"agent": "support"}, 2.0)]
            assert process.errors() == []
    finally:
        await tool.stop()
        for key in made:
            await redis.delete(key)


async def test_an_intake_queue_no_worker_consumes_is_left_alone(
    scripted_model: ScriptedModel,
    clients: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    tmp_path: Path,
    uid: str,
    cleanup: None,
) -> None:
    """acme's intake queue is left from workers that kept one for it; today's workers keep
    none (``LOOPWIRE_TENANTS__INTAKE=[]``): acme's client sends its turn to ``loopwire.turns``
    instead, and it runs; nothing waits in the queue for nobody."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        intake = await channel.get_exchange(t.INTAKE_EXCHANGE)
        stale = await channel.declare_queue(
            t.intake_queue("acme"), durable=True, arguments=TURNS_ARGUMENTS
        )
        await stale.bind(intake, routing_key=t.intake_key("acme"))
        scripted_model.expect(Reply.text("still served"))
        async with tenant_worker(
            scripted_model, tenant_users, tmp_path, LOOPWIRE_TENANTS__INTAKE="[]"
        ) as process:
            result = await clients["acme"].run_turn("support", "hi", session_id=f"s-{uid}")
            assert process.errors() == []
        left = await channel.declare_queue(t.intake_queue("acme"), passive=True)
        assert left.declaration_result.message_count == 0
    assert result.content == "still served"
