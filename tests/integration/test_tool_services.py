"""Tool services against the real RabbitMQ and Redis, called exactly as a worker calls them."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aio_pika
import aiormq
import pytest
from aio_pika.exceptions import DeliveryError, PublishError
from pydantic import BaseModel, ConfigDict
from redis.asyncio import Redis
from support_rpc import RpcCaller, wait_announced, wait_until

from contracts import keys
from contracts.codec import decode_obj, encode
from contracts.registry import live_tools
from contracts.tools import ToolAnnouncement, ToolDefinition
from contracts.topology import TOOLS_EXCHANGE, tool_queue
from tool_services.calculator import create_service as create_calculator
from tool_services.notes import create_service as create_notes
from tool_services.registry import Announcer
from tool_services.sdk import CallContext, ToolError, ToolService
from tool_services.search import create_service as create_search

pytestmark = pytest.mark.integration

SLOW_SERVICE = "tests.tool_fixtures.slow_service"


class EchoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str
    times: int = 1


class Probe:
    """Counts executions and concurrent executions of the test tools."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.running = 0
        self.max_running = 0
        self.started = asyncio.Event()
        self.takeovers: list[bool] = []

    async def run(self, args: EchoArgs, ctx: CallContext, seconds: float) -> dict[str, Any]:
        self.texts.append(args.text)
        self.takeovers.append(ctx.takeover)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.started.set()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1
        return {"echo": args.text * args.times, "run": len(self.texts), "session": ctx.session_id}


def echo_service(
    uid: str, probe: Probe, *, seconds: float = 0.0, idempotent: bool = True, timeout_s: float = 30
) -> ToolService:
    service = ToolService(f"test-{uid}")

    @service.tool(
        name=f"echo_{uid}", description="Echo the text.", idempotent=idempotent, timeout_s=timeout_s
    )
    async def echo(args: EchoArgs, ctx: CallContext) -> dict[str, Any]:
        return await probe.run(args, ctx, seconds)

    @service.tool(name=f"twin_{uid}", description="Echo the text, too.")
    async def twin(args: EchoArgs, ctx: CallContext) -> dict[str, Any]:
        return await probe.run(args, ctx, seconds)

    @service.tool(name=f"fail_{uid}", description="Always fails.")
    async def fail(args: EchoArgs, ctx: CallContext) -> None:
        if args.text == "tool-error":
            raise ToolError("the widget is out of stock")
        raise RuntimeError(f"boom: {args.text}")

    return service


async def test_live_tools_lists_announced_tools_of_live_instances_only(
    serve: Any, redis: Redis, uid: str
) -> None:
    server = await serve(echo_service(uid, Probe()))
    tools = await live_tools(redis)
    echo = tools[f"echo_{uid}"]
    assert echo.description == "Echo the text."
    assert echo.parameters["required"] == ["text"]
    assert set(echo.parameters["properties"]) == {"text", "times"}
    assert f"fail_{uid}" in tools

    now = time.time()
    dead = ToolAnnouncement(
        service=f"test-{uid}",
        instance_id=f"dead-{uid}",
        tools=(ToolDefinition(name=f"ghost_{uid}"),),
        announced_at=now - 20,
        expires_at=now - 10,
    )
    await redis.hset(keys.tool_registry(), f"dead-{uid}", encode(dead))
    await redis.hset(keys.tool_registry(), f"garbage-{uid}", b"\xc1 not msgpack")
    tools = await live_tools(redis)
    assert f"ghost_{uid}" not in tools
    assert f"echo_{uid}" in tools
    assert not await redis.hexists(keys.tool_registry(), f"dead-{uid}")
    assert not await redis.hexists(keys.tool_registry(), f"garbage-{uid}")
    # Judged against the given clock: once its announcement expires, the tool is gone.
    assert f"echo_{uid}" not in await live_tools(redis, now=now + 60)

    await server.stop()  # a clean shutdown withdraws the announcement at once
    assert f"echo_{uid}" not in await live_tools(redis)
    assert not await redis.hexists(keys.tool_registry(), server.instance_id)


async def test_a_heartbeat_removes_what_crashed_instances_announced(redis: Redis, uid: str) -> None:
    now = time.time()
    crashed = ToolAnnouncement(
        service=f"test-{uid}",
        instance_id=f"crashed-{uid}",
        tools=(ToolDefinition(name=f"ghost_{uid}"),),
        announced_at=now - 60,
        expires_at=now - 15,
    )
    await redis.hset(keys.tool_registry(), crashed.instance_id, encode(crashed))
    live = Announcer(
        redis,
        service=f"test-{uid}",
        instance_id=f"live-{uid}",
        tools=(ToolDefinition(name=f"echo_{uid}"),),
        interval_s=5,
        ttl_s=45,
    )
    await live.announce()  # no worker reads the registry meanwhile
    assert not await redis.hexists(keys.tool_registry(), crashed.instance_id)
    assert await redis.hexists(keys.tool_registry(), live.instance_id)
    assert await redis.ttl(keys.tool_registry()) >= 40, "gone once nobody announces"
    await live.stop()


async def test_invalid_arguments_are_an_error_reply_and_the_tool_does_not_run(
    serve: Any, caller: RpcCaller, uid: str
) -> None:
    probe = Probe()
    await serve(echo_service(uid, probe))
    tool, turn = f"echo_{uid}", f"t-{uid}"

    reply = await caller.call(caller.request(tool, {}, turn_id=turn))
    assert (reply.status, reply.error) == ("error", "invalid arguments: text: Field required")
    reply = await caller.call(caller.request(tool, {"text": "a", "times": "x"}, turn_id=turn))
    assert reply.status == "error"
    assert reply.error is not None
    assert reply.error.startswith("invalid arguments: times: Input should be a valid integer")
    reply = await caller.call(caller.request(tool, {"text": "a", "loud": True}, turn_id=turn))
    assert reply.error == "invalid arguments: loud: Extra inputs are not permitted"
    assert probe.texts == []

    reply = await caller.call(caller.request(tool, {"text": "ab", "times": 2}, turn_id=turn))
    assert reply.status == "ok"
    assert reply.value == {"echo": "abab", "run": 1, "session": "s-test"}


async def test_exceptions_and_garbage_never_kill_the_service(
    serve: Any, caller: RpcCaller, amqp: Any, uid: str
) -> None:
    server = await serve(echo_service(uid, Probe()))
    turn = f"t-{uid}"

    reply = await caller.call(caller.request(f"fail_{uid}", {"text": "x"}, turn_id=turn))
    assert (reply.status, reply.error) == ("error", "RuntimeError: boom: x")
    reply = await caller.call(caller.request(f"fail_{uid}", {"text": "tool-error"}, turn_id=turn))
    assert (reply.status, reply.error) == ("error", "the widget is out of stock")

    # Undecodable bodies: an error reply when it can be addressed, acked either way.
    garbage = caller.request(f"echo_{uid}", {"text": "x"}, turn_id=turn)
    reply = await caller.call(garbage, body=b"\xc1\x00 this is not msgpack")
    assert reply.status == "error"
    assert reply.error is not None
    assert reply.error.startswith("undecodable tool call: not valid msgpack")
    unaddressed = caller.request(f"echo_{uid}", {"text": "x"}, turn_id=turn)
    await caller.send(unaddressed, body=encode(ToolDefinition(name="wrong")), reply_to="")

    reply = await caller.call(caller.request(f"echo_{uid}", {"text": "still here"}, turn_id=turn))
    assert reply.status == "ok"
    await server.stop()  # unacked deliveries would return to the queue now
    channel = await amqp.channel()
    queue = await channel.declare_queue(tool_queue(f"echo_{uid}"), passive=True)
    assert queue.declaration_result.message_count == 0
    await channel.close()
    assert caller.replies.get(unaddressed.call_id) is None


async def test_a_duplicate_call_runs_once_and_gets_the_same_reply(
    serve: Any, caller: RpcCaller, redis: Redis, uid: str
) -> None:
    probe = Probe()
    await serve(echo_service(uid, probe, seconds=0.4, idempotent=False))
    request = caller.request(f"echo_{uid}", {"text": "once"}, turn_id=f"t-{uid}")

    first = await caller.send(request)
    await asyncio.wait_for(probe.started.wait(), 5)
    # The same call again while it runs (a new worker repeating the step): it waits.
    second = await caller.send(request, correlation_id=f"{request.call_id}-2")
    reply1 = await caller.wait_reply(first)
    reply2 = await caller.wait_reply(second)
    assert reply1.status == "ok"
    assert reply2 == reply1
    # And again once it finished: answered from the stored reply.
    reply3 = await caller.call(request, correlation_id=f"{request.call_id}-3")
    assert reply3 == reply1
    assert probe.texts == ["once"]

    key = request.context.idempotency_key
    assert caller.reply_headers[first][0]["idempotency-key"] == key
    stored = await redis.hgetall(keys.tool_call(key))
    assert stored[b"status"] == b"ok"
    assert stored[b"owner"]
    assert 0 < await redis.ttl(keys.tool_call(key)) <= 86_400
    assert not await redis.exists(keys.tool_call_lease(key))


async def test_a_call_whose_owner_died_is_taken_over_only_when_idempotent(
    serve: Any, caller: RpcCaller, redis: Redis, uid: str
) -> None:
    idem, once = Probe(), Probe()
    await serve(echo_service(uid, idem, idempotent=True))
    await serve(echo_service(f"{uid}n", once, idempotent=False))
    # A claim without a lease: its owner died mid-call.
    retried = caller.request(f"echo_{uid}", {"text": "again"}, turn_id=f"t-{uid}")
    risky = caller.request(f"echo_{uid}n", {"text": "mail"}, turn_id=f"t-{uid}")
    for request in (retried, risky):
        await redis.hset(keys.tool_call(request.context.idempotency_key), "owner", "dead-1")

    reply = await caller.call(retried)
    assert reply.status == "ok"
    assert idem.takeovers == [True]

    reply = await caller.call(risky)
    assert reply.status == "unknown"
    assert reply.error is not None
    assert "may or may not have taken effect" in reply.error
    again = await caller.call(risky, correlation_id=f"{risky.call_id}-again")
    assert again == reply
    assert once.texts == []


async def test_an_unbound_tool_is_returned_by_the_broker_at_once(
    amqp: Any, caller: RpcCaller, uid: str
) -> None:
    request = caller.request(f"nobody_{uid}", {}, turn_id=f"t-{uid}")
    started = time.monotonic()
    # Publisher confirms + on_return_raises=True: publish raises PublishError (a DeliveryError).
    with pytest.raises(PublishError) as raised:
        await caller.send(request)
    assert isinstance(raised.value, DeliveryError)
    assert isinstance(raised.value.frame, aiormq.spec.Basic.Return)
    assert raised.value.frame.reply_code == 312  # NO_ROUTE
    assert time.monotonic() - started < 2

    body = aio_pika.Message(encode(request), message_id=f"m-{uid}")
    # Publisher confirms, on_return_raises=False (aio-pika's default): the returned message.
    channel = await amqp.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(TOOLS_EXCHANGE)
    result = await exchange.publish(body, routing_key=f"nobody_{uid}", mandatory=True)
    assert isinstance(result, aiormq.abc.DeliveredMessage)
    assert isinstance(result.delivery, aiormq.spec.Basic.Return)
    assert result.delivery.reply_code == 312
    await channel.close()
    # No publisher confirms: publish returns None and the return goes unnoticed.
    channel = await amqp.channel(publisher_confirms=False)
    exchange = await channel.get_exchange(TOOLS_EXCHANGE)
    assert await exchange.publish(body, routing_key=f"nobody_{uid}", mandatory=True) is None
    await channel.close()


async def test_a_tool_running_past_its_timeout_gets_an_error_reply(
    serve: Any, caller: RpcCaller, uid: str
) -> None:
    probe = Probe()
    await serve(echo_service(uid, probe, seconds=5, timeout_s=0.3))
    started = time.monotonic()
    reply = await caller.call(caller.request(f"echo_{uid}", {"text": "zz"}, turn_id=f"t-{uid}"))
    assert (reply.status, reply.error) == ("error", "timed out after 0.3s")
    assert time.monotonic() - started < 2
    assert probe.running == 0  # the function was cancelled, not left running

    await serve(echo_service(f"{uid}d", Probe(), seconds=5, timeout_s=30))
    request = caller.request(f"echo_{uid}d", {"text": "zz"}, turn_id=f"t-{uid}", deadline_s=0.5)
    reply = await caller.call(request)
    assert reply.status == "error"
    assert reply.error is not None
    assert reply.error.startswith("the call's deadline passed after 0.")


async def test_a_call_past_its_deadline_is_dropped_without_running(
    serve: Any, caller: RpcCaller, redis: Redis, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    probe = Probe()
    await serve(echo_service(uid, probe))
    late = caller.request(
        f"echo_{uid}", {"text": "late"}, turn_id=f"t-{uid}", deadline=time.time() - 1
    )
    await caller.send(late, expiration_s=30)  # the broker delivers it; the service must drop it
    reply = await caller.call(
        caller.request(f"echo_{uid}", {"text": "on time"}, turn_id=f"t-{uid}")
    )
    assert reply.status == "ok"
    dropped = f"dropping call {late.call_id}"
    await wait_until(lambda: any(dropped in r.getMessage() for r in caplog.records))
    assert caller.replies.get(late.call_id) is None
    assert probe.texts == ["on time"]
    assert not await redis.exists(keys.tool_call(late.context.idempotency_key))


async def test_the_concurrency_limit_holds(serve: Any, caller: RpcCaller, uid: str) -> None:
    probe = Probe()
    await serve(echo_service(uid, probe, seconds=0.25), concurrency=3)
    requests = [
        caller.request(f"echo_{uid}", {"text": str(i)}, turn_id=f"t-{uid}") for i in range(10)
    ]
    replies = await asyncio.gather(*(caller.call(r) for r in requests))
    assert [r.status for r in replies] == ["ok"] * 10
    assert sorted(probe.texts, key=int) == [str(i) for i in range(10)]
    assert probe.max_running == 3


async def test_stop_finishes_running_calls_and_hands_back_waiting_ones(
    serve: Any, caller: RpcCaller, uid: str
) -> None:
    probe = Probe()
    server = await serve(echo_service(uid, probe, seconds=0.5), concurrency=1, grace_s=5)
    running = caller.request(f"echo_{uid}", {"text": "running"}, turn_id=f"t-{uid}")
    # Another tool of the service: its own consumer, so it is delivered, then waits for the slot.
    waiting = caller.request(f"twin_{uid}", {"text": "waiting"}, turn_id=f"t-{uid}")
    await caller.send(running)
    await asyncio.wait_for(probe.started.wait(), 5)
    await caller.send(waiting)
    await wait_until(lambda: server.waiting_for_slot == 1)

    assert await server.stop() is True
    assert (await caller.wait_reply(running.call_id)).status == "ok"
    assert probe.texts == ["running"]  # the waiting call was requeued, not run
    await serve(echo_service(uid, probe))
    assert (await caller.wait_reply(waiting.call_id)).status == "ok"
    assert probe.texts == ["running", "waiting"]


async def test_a_killed_service_is_replaced_and_the_interrupted_call_is_not_run_again(
    spawn: Any, caller: RpcCaller, redis: Redis, uid: str
) -> None:
    tool, service, record = f"slow_{uid}", f"slow-{uid}", f"lw:test:{uid}:record"
    env = {
        "LW_TEST_TOOL": tool,
        "LW_TEST_SERVICE": service,
        "LW_TEST_RECORD": record,
        "LW_TEST_SLEEP": "30",
    }
    first = await spawn(SLOW_SERVICE, tool=tool, env=env)
    first_id = await wait_announced(redis, service)
    request = caller.request(tool, {"label": "mail"}, turn_id=f"t-{uid}", deadline_s=45)
    sent = await caller.send(request)
    await wait_until(lambda: _has_items(redis, record, 1))

    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    second = await spawn(SLOW_SERVICE, tool=tool, env=env)
    await wait_announced(redis, service, exclude={first_id})

    # The broker redelivers the unacked call to the new instance, which finds the
    # dead owner's claim (its lease runs out within ~3 s) and answers "unknown".
    reply = await caller.wait_reply(sent, timeout=20)
    assert reply.status == "unknown", second.output()
    # The caller asking again (a new worker, same idempotency key) hears the same.
    again = await caller.call(request, correlation_id=f"{request.call_id}-again")
    assert again == reply
    assert await redis.lrange(record, 0, -1) == [f"start:{request.call_id}".encode()]

    second.signal(signal.SIGTERM)
    assert await second.wait() == 0, second.output()


async def test_sigterm_drains_the_call_in_flight_and_exits_0(
    spawn: Any, caller: RpcCaller, redis: Redis, uid: str
) -> None:
    tool, service, record = f"slow_{uid}", f"slow-{uid}", f"lw:test:{uid}:record"
    env = {
        "LW_TEST_TOOL": tool,
        "LW_TEST_SERVICE": service,
        "LW_TEST_RECORD": record,
        "LW_TEST_SLEEP": "1.0",
        "LOOPWIRE_TOOLS__GRACE_S": "10",
    }
    child = await spawn(SLOW_SERVICE, tool=tool, env=env)
    await wait_announced(redis, service)
    request = caller.request(tool, {"label": "drain"}, turn_id=f"t-{uid}")
    sent = await caller.send(request)
    await wait_until(lambda: _has_items(redis, record, 1))

    child.signal(signal.SIGTERM)
    reply = await caller.wait_reply(sent, timeout=10)
    assert reply.status == "ok", child.output()
    assert reply.value == {"slept": 1.0, "label": "drain"}
    assert await child.wait(15) == 0, child.output()
    assert await redis.lrange(record, 0, -1) == [
        f"start:{request.call_id}".encode(),
        f"end:{request.call_id}".encode(),
    ]
    assert tool not in await live_tools(redis)


async def test_the_example_services_answer_real_calls(
    serve: Any, caller: RpcCaller, redis: Redis, uid: str
) -> None:
    search, calculate, note = f"search_{uid}", f"calculate_{uid}", f"file_note_{uid}"
    await serve(create_search().renamed({"search": search}))
    await serve(create_calculator().renamed({"calculate": calculate}))
    await serve(create_notes().renamed({"file_note": note}))
    tools = await live_tools(redis)
    assert (tools[search].idempotent, tools[calculate].idempotent) == (True, True)
    assert tools[note].idempotent is False

    async def call(tool: str, arguments: dict[str, Any], **context: Any) -> Any:
        reply = await caller.call(caller.request(tool, arguments, turn_id=f"t-{uid}", **context))
        assert reply.status == "ok", reply.error
        return reply

    found = (await call(search, {"query": "dead letter queue reason"})).value["results"]
    assert found[0]["path"] == "docs/dead-letter-queue.md"
    assert found[0]["title"] == "The dead-letter queue"
    assert "**" in found[0]["snippet"]
    assert found[0]["score"] > 0
    assert (await call(search, {"query": "xyzzy plugh frobnicate"})).value == {"results": []}
    tricky = await call(search, {"query": 'NEAR("shutdown" * -:grace OR', "limit": 2})
    assert len(tricky.value["results"]) <= 2

    exact = await call(calculate, {"expression": "2**100 / 3"})
    assert exact.value["value"] == "1267650600228229401496703205376/3"
    assert exact.value["expression"] == "2**100 / 3"
    for expression, error in [("1/0", "division by zero"), ("10**10**10", "more than 4000 digits")]:
        reply = await caller.call(
            caller.request(calculate, {"expression": expression}, turn_id=f"t-{uid}")
        )
        assert reply.status == "error"
        assert reply.error is not None
        assert error in reply.error

    session = f"s-{uid}"
    first = await call(note, {"text": "refund approved", "tags": ["billing"]}, session_id=session)
    second = await call(note, {"text": "call back on Monday"}, session_id=session)
    assert first.value["filed"] is True
    assert (first.value["count"], second.value["count"]) == (1, 2)
    assert second.state_updates == {"notes_count": 2}
    assert not {"items", "results", "matches", "passages", "data"} & set(second.value)
    items: list[Any] = await redis.lrange(keys.session_notes(session), 0, -1)
    stored = [decode_obj(item) for item in items]
    assert [n["text"] for n in stored] == ["refund approved", "call back on Monday"]
    assert stored[0]["note_id"] == first.value["note_id"]


async def _has_items(redis: Redis, key: str, count: int) -> bool:
    return int(await redis.llen(key)) >= count
