"""The HTTP gateway from the outside: the real ``langgraph-sdk`` client against
``loopwire gateway serve`` in front of a worker, the broker and Redis, the model scripted.
Threads, runs (wait, background, stream, join, cancel), API keys and tenants, bad input."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import httpx
import pytest
from aiohttp import web
from gateway_support import GatewayProcess
from langgraph_sdk import get_client
from redis.asyncio import Redis
from standardwebhooks.webhooks import Webhook
from support_rpc import AMQP_URL, wait_until
from tenant_support import drop_intake_queues, trusting_worker

from contracts import topology as t
from harness import WorkerProcess, free_port
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


@pytest.fixture
async def sdk(fleet: GatewayProcess) -> AsyncIterator[Any]:
    """The ``langgraph-sdk`` client with the key of ``ops``."""
    async with get_client(url=fleet.url, api_key=fleet.keys["ops"]) as client:
        yield client


@pytest.fixture
async def fleet(
    scripted_model: ScriptedModel, topology: None, tmp_path: Path, redis: Redis
) -> AsyncIterator[GatewayProcess]:
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps(
            {
                "agents": [
                    {"name": "support", "description": "Answers questions.", "tools": []},
                    {"name": "writer", "tools": [], "stream": True},
                    {
                        "name": "classifier",
                        "tools": [],
                        "output_schema": {
                            "type": "object",
                            "properties": {"label": {"type": "string"}},
                            "required": ["label"],
                        },
                    },
                ]
            }
        )
    )
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    async with worker, GatewayProcess(agents, {"ops": None}) as gateway:
        yield gateway
        assert worker.errors() == []
    async for key in redis.scan_iter(match="lw:threads:*"):
        await redis.delete(key)


async def test_a_thread_and_its_runs_through_the_sdk(
    sdk: Any, scripted_model: ScriptedModel
) -> None:
    client = sdk
    found = await client.assistants.search()
    assert {a["assistant_id"] for a in found} == {"support", "writer", "classifier"}
    assert (await client.assistants.get("support"))["description"] == "Answers questions."
    schemas = await client.assistants.get_schemas("classifier")
    assert schemas["output_schema"]["required"] == ["label"]
    assert schemas["input_schema"]["required"] == ["messages"]
    assert (await client.assistants.get_schemas("support"))["output_schema"] is None

    marker = uuid.uuid4().hex
    thread = await client.threads.create(metadata={"customer": marker})
    thread_id = thread["thread_id"]
    assert thread["metadata"] == {"customer": marker}
    scripted_model.expect(Reply.text("Hello there."))
    values = await client.runs.wait(
        thread_id, "support", input={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert [(m["type"], m["content"]) for m in values["messages"]] == [
        ("human", "hi"),
        ("ai", "Hello there."),
    ]
    state = await client.threads.get_state(thread_id)
    assert state["values"] == values
    again = await client.threads.get(thread_id)
    assert again["status"] == "idle" and again["metadata"] == {"customer": marker}
    (run,) = await client.runs.list(thread_id)
    assert run["status"] == "success" and run["assistant_id"] == "support"
    assert (await client.runs.get(thread_id, run["run_id"]))["status"] == "success"
    searched = await client.threads.search(metadata={"customer": marker})
    assert [t["thread_id"] for t in searched] == [thread_id]

    # a background run, then joined
    scripted_model.expect(Reply.text("Second answer."))
    created = await client.runs.create(
        thread_id, "support", input={"messages": [{"role": "user", "content": "more"}]}
    )
    joined = await client.runs.join(thread_id, created["run_id"])
    assert joined["messages"][-1]["content"] == "Second answer."
    assert len(joined["messages"]) == 4

    await client.threads.delete(thread_id)
    with pytest.raises(httpx.HTTPStatusError) as gone:
        await client.threads.get(thread_id)
    assert gone.value.response.status_code == 404


async def test_a_run_streams_metadata_first_chunks_values_and_end_last(
    sdk: Any, scripted_model: ScriptedModel
) -> None:
    client = sdk
    thread = await client.threads.create()
    scripted_model.expect(Reply.text("A streamed answer in several words."))
    parts = [
        part
        async for part in client.runs.stream(
            thread["thread_id"],
            "writer",
            input={"messages": [{"role": "user", "content": "write"}]},
            stream_mode=["values", "updates", "messages-tuple"],
        )
    ]
    events = [p.event for p in parts]
    assert events[0] == "metadata" and events[-1] == "end", events
    chunks = [p.data[0]["content"] for p in parts if p.event == "messages"]
    assert "".join(chunks) == "A streamed answer in several words.", chunks
    updates = [p.data for p in parts if p.event == "updates"]
    assert updates[-1]["agent"]["messages"][-1]["content"] == "A streamed answer in several words."
    last_values = [p.data for p in parts if p.event == "values"][-1]
    assert [m["type"] for m in last_values["messages"]] == ["human", "ai"]
    assert parts[-1].data["status"] == "success"
    # each id says where the client is (step, text offset, messages known): never backwards
    assert parts[-1].id == "end"
    places = [tuple(int(n) for n in p.id.split(".")) for p in parts[:-1]]
    assert places == sorted(places) and places[-1][2] == 2, places


async def test_no_key_a_wrong_key_and_bad_input_are_refused_with_json_and_touch_nothing(
    fleet: GatewayProcess,
) -> None:
    async with aiohttp.ClientSession(base_url=fleet.url) as http:

        async def ask(method: str, path: str, **options: Any) -> tuple[int, Any]:
            async with http.request(method, path, **options) as response:
                return response.status, await response.json()

        assert (await ask("POST", "/threads"))[0] == 401
        status, body = await ask("POST", "/threads", headers={"x-api-key": "nope"})
        assert status == 401 and "API key" in body["detail"]
        key = {"Authorization": f"Bearer {fleet.keys['ops']}"}
        status, body = await ask("POST", "/threads", headers=key, data=b"{not json")
        assert status == 400 and "not JSON" in body["detail"]
        status, body = await ask("GET", "/threads/bad%20id!", headers=key)
        assert status == 422 and "not a valid id" in body["detail"]
        status, body = await ask("GET", f"/threads/{uuid.uuid4()}", headers=key)
        assert status == 404
        thread = (await ask("POST", "/threads", headers=key, json={}))[1]["thread_id"]
        run = {"assistant_id": "nobody", "input": {"messages": [{"role": "user", "content": "x"}]}}
        status, body = await ask("POST", f"/threads/{thread}/runs/wait", headers=key, json=run)
        assert status == 404 and "no assistant 'nobody'" in body["detail"]
        run = {"assistant_id": "support", "input": {"messages": [{"role": "ai", "content": "x"}]}}
        status, body = await ask("POST", f"/threads/{thread}/runs/wait", headers=key, json=run)
        assert status == 422 and "user" in body["detail"]
        big = io.BytesIO(json.dumps({"metadata": {"x": "y" * 2_000_000}}).encode())
        status, body = await ask("POST", "/threads", headers=key, data=big)
        assert status == 413
        status, body = await ask(
            "GET", f"/threads/{thread}/runs/{uuid.uuid4()}/stream", headers=key
        )
        assert status == 404
        status, _ = await ask("GET", "/ok")
        assert status == 200
    # the model was never asked (the fixture fails on an unexpected call)


async def test_a_tenants_key_reaches_its_own_threads_only(
    scripted_model: ScriptedModel, topology: None, tmp_path: Path, redis: Redis
) -> None:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    worker = trusting_worker(scripted_model, agents, ("acme", "globex"))
    tenants = {"acme-key": "acme", "globex-key": "globex"}
    async with worker, GatewayProcess(agents, tenants) as gateway:
        async with (
            get_client(url=gateway.url, api_key=gateway.keys["acme-key"]) as acme,
            get_client(url=gateway.url, api_key=gateway.keys["globex-key"]) as globex,
        ):
            thread = await acme.threads.create(thread_id=f"s-{uuid.uuid4().hex[:8]}")
            thread_id = thread["thread_id"]
            scripted_model.expect(Reply.text("for acme"))
            await acme.runs.wait(thread_id, "support", input={"messages": ["hi"]})
            (run,) = await acme.runs.list(thread_id)
            for attempt in (
                globex.threads.get(thread_id),
                globex.threads.get_state(thread_id),
                globex.runs.get(thread_id, run["run_id"]),
                globex.runs.join(thread_id, run["run_id"]),
                globex.threads.delete(thread_id),
            ):
                with pytest.raises(httpx.HTTPStatusError) as refused:
                    await attempt
                assert refused.value.response.status_code == 404
            # globex's own thread of the same id is another thread
            await globex.threads.create(thread_id=thread_id)
            assert (await globex.threads.get_state(thread_id))["values"] == {"messages": []}
            assert (await acme.threads.get_state(thread_id))["values"]["messages"][-1][
                "content"
            ] == "for acme"
        assert worker.errors() == []
    for tenant in tenants.values():
        async for key in redis.scan_iter(match=f"lw:{{{tenant}/*"):
            await redis.delete(key)
        await redis.delete(f"lw:threads:{tenant}")
    drop_intake_queues(("acme", "globex"))


async def test_a_gateway_killed_mid_run_loses_nothing_the_client_joins_through_another(
    scripted_model: ScriptedModel, topology: None, tmp_path: Path
) -> None:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    asked = asyncio.Event()
    release = asyncio.Event()

    async def held(body: dict[str, Any]) -> Reply:
        asked.set()
        await release.wait()
        return Reply.text("worth the wait")

    scripted_model.respond_with(held)
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    async with worker, GatewayProcess(agents, {"ops": None}) as first:
        async with (
            GatewayProcess(agents, {}, replica_of=first) as second,
            get_client(url=first.url, api_key=first.keys["ops"]) as one,
            get_client(url=second.url, api_key=second.keys["ops"]) as two,
        ):
            thread_id = (await one.threads.create())["thread_id"]
            parts = one.runs.stream(thread_id, "support", input={"messages": ["wait"]})
            metadata = await anext(aiter(parts))
            assert metadata.event == "metadata"
            run_id = metadata.data["run_id"]
            await asyncio.wait_for(asked.wait(), 20)
            first.stop()  # SIGKILL, mid-run
            release.set()
            joined = await two.runs.join(thread_id, run_id)
            await parts.aclose()
        assert joined["messages"][-1]["content"] == "worth the wait"
        assert worker.errors() == []


async def test_a_stream_dropped_mid_answer_and_rejoined_misses_nothing_and_repeats_nothing(
    sdk: Any, scripted_model: ScriptedModel
) -> None:
    """The client drops its stream after a few chunks, then rejoins with the last id it had
    (through the SDK's ``join_stream``): the chunks before and after make the whole answer once,
    and the rest of the run's events follow."""
    client = sdk
    answer = " ".join(f"word{i}" for i in range(120))
    scripted_model.expect(Reply.text(answer, chunk_delay=0.02))
    thread_id = (await client.threads.create())["thread_id"]
    modes = ["values", "updates", "messages-tuple"]
    first = client.runs.stream(
        thread_id, "writer", input={"messages": ["write"]}, stream_mode=modes
    )
    before = []
    async for part in first:
        before.append(part)
        if sum(p.event == "messages" for p in before) == 3:
            break
    await first.aclose()  # the connection drops mid-answer
    run_id = before[0].data["run_id"]
    after = [
        part
        async for part in client.runs.join_stream(
            thread_id, run_id, stream_mode=modes, last_event_id=before[-1].id
        )
    ]
    text = "".join(p.data[0]["content"] for p in before + after if p.event == "messages")
    assert text == answer
    events = [p.event for p in after]
    assert events[-1] == "end" and "values" in events and "updates" in events, events
    assert after[-1].data["status"] == "success"
    updated = [
        m["content"] for p in after if p.event == "updates" for m in p.data["agent"]["messages"]
    ]
    assert updated == ["write", answer]  # each message once, across the updates


async def test_a_run_waiting_for_approval_is_interrupted_and_a_resume_command_decides_it(
    scripted_model: ScriptedModel, topology: None, tmp_path: Path, lookup: Any
) -> None:
    """The model calls a tool that needs approval: the run is interrupted (the wait returns the
    interrupt, the thread is interrupted with the call in its state); a run created with
    ``command: {"resume": ...}`` edits the call's arguments and the same turn goes on, then a
    second interrupt is rejected with a message for the model."""
    agents = tmp_path / "agents.json"
    agent = {"name": "support", "tools": [lookup.name], "approval": [lookup.name]}
    agents.write_text(json.dumps({"agents": [agent]}))
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "shoes"}, "c1")))
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "socks"}, "c2")))
    scripted_model.expect(Reply.text("Found boots; skipped the socks."))
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    async with (
        worker,
        GatewayProcess(agents, {"ops": None}) as gateway,
        get_client(url=gateway.url, api_key=gateway.keys["ops"]) as client,
    ):
        thread_id = (await client.threads.create())["thread_id"]
        first = await client.runs.wait(thread_id, "support", input={"messages": ["find shoes"]})
        (waiting,) = first["__interrupt__"]
        until = waiting["value"].pop("until")  # the approval timeout's end (a default)
        assert until > time.time()
        assert waiting["value"] == {
            "call_id": "c1",
            "tool": lookup.name,
            "arguments": {"q": "shoes"},
        }
        thread = await client.threads.get(thread_id)
        assert thread["status"] == "interrupted"
        state = await client.threads.get_state(thread_id)
        assert [i["id"] for i in state["interrupts"]] == ["c1"] and state["next"] == ["agent"]
        (run,) = await client.runs.list(thread_id)
        assert (await client.runs.get(thread_id, run["run_id"]))["status"] == "interrupted"

        edit = {"decision": "edit", "arguments": {"q": "boots"}}
        second = await client.runs.wait(thread_id, "support", command={"resume": {"c1": edit}})
        assert [i["id"] for i in second["__interrupt__"]] == ["c2"]
        reject = {"decision": "reject", "message": "no socks today"}
        parts = [
            p
            async for p in client.runs.stream(
                thread_id, "support", command={"resume": reject}, stream_mode=["values"]
            )
        ]
        assert parts[-1].event == "end" and parts[-1].data["status"] == "success"
        final = parts[-2].data["messages"]
        assert final[-1]["content"] == "Found boots; skipped the socks."
        results = [m["content"] for m in final if m["type"] == "tool"]
        assert "found boots" in results[0] and "no socks today" in results[1], results
        assert (await client.threads.get(thread_id))["status"] == "idle"
        with pytest.raises(httpx.HTTPStatusError) as nothing_waits:
            await client.runs.wait(thread_id, "support", command={"resume": reject})
        assert nothing_waits.value.response.status_code == 409
        assert worker.errors() == []
    assert sum(lookup.executions.values()) == 1  # the edited call ran; the rejected one never did


async def test_a_runs_webhook_is_signed_retried_and_sent_once_and_internal_ones_are_refused(
    scripted_model: ScriptedModel, topology: None, tmp_path: Path
) -> None:
    """A run created with a webhook: its end is posted to a receiver that fails the first try
    and takes the second, signed so that the Standard Webhooks library verifies it, with the
    run id as the delivery's id. A webhook to an internal address that is not allowed, or not
    over HTTP, is refused when the run is created."""
    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    received: list[tuple[bytes, dict[str, str]]] = []
    tries = 0

    async def receive(request: web.Request) -> web.Response:
        nonlocal tries
        tries += 1
        if tries == 1:
            return web.Response(status=503)
        received.append((await request.read(), dict(request.headers)))
        return web.Response(status=204)

    receiver = web.Application()
    receiver.router.add_post("/hook", receive)
    runner = web.AppRunner(receiver)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    scripted_model.expect(Reply.text("done, and told"))
    settings = {
        "LOOPWIRE_GATEWAY__WEBHOOK_SECRET": secret,
        "LOOPWIRE_GATEWAY__WEBHOOK_ALLOW": '["127.0.0.1"]',
    }
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    try:
        async with (
            worker,
            GatewayProcess(agents, {"ops": None}, **settings) as gateway,
            get_client(url=gateway.url, api_key=gateway.keys["ops"]) as client,
        ):
            thread_id = (await client.threads.create())["thread_id"]
            for refused in ("http://10.1.2.3/hook", "ftp://127.0.0.1/hook"):
                with pytest.raises(httpx.HTTPStatusError) as no:
                    await client.runs.create(
                        thread_id, "support", input={"messages": ["x"]}, webhook=refused
                    )
                assert no.value.response.status_code == 422
            run = await client.runs.create(
                thread_id,
                "support",
                input={"messages": ["go"]},
                webhook=f"http://127.0.0.1:{port}/hook",
            )
            await wait_until(lambda: bool(received), timeout=30)
            await asyncio.sleep(0.5)  # a second delivery would come by now
            assert worker.errors() == []
    finally:
        await runner.cleanup()
        async with await aio_pika.connect(AMQP_URL) as connection:
            channel = await connection.channel()
            await channel.queue_delete(t.GATEWAY_WEBHOOKS_QUEUE)
    assert tries == 2 and len(received) == 1
    body, headers = received[0]
    Webhook(secret).verify(body, headers)  # raises unless signed with the secret
    assert headers["webhook-id"] == run["run_id"]
    sent = json.loads(body)
    assert sent["run_id"] == run["run_id"] and sent["status"] == "success"
    assert sent["values"]["messages"][-1]["content"] == "done, and told"


async def test_a_run_sent_while_another_runs_waits_is_refused_or_interrupts_it(
    sdk: Any, scripted_model: ScriptedModel
) -> None:
    client = sdk
    asked = asyncio.Event()
    release = asyncio.Event()

    async def answer(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["content"] == "slow":
            asked.set()
            await release.wait()
            return Reply.text("slow answer")
        return Reply.text("quick answer")

    scripted_model.respond_with(answer)
    thread_id = (await client.threads.create())["thread_id"]
    slow = await client.runs.create(thread_id, "support", input={"messages": ["slow"]})
    await asyncio.wait_for(asked.wait(), 20)
    with pytest.raises(httpx.HTTPStatusError) as busy:
        await client.runs.create(
            thread_id, "support", input={"messages": ["x"]}, multitask_strategy="reject"
        )
    assert busy.value.response.status_code == 409
    values = await client.runs.wait(
        thread_id, "support", input={"messages": ["quick"]}, multitask_strategy="interrupt"
    )
    release.set()
    assert values["messages"][-1]["content"] == "quick answer"
    assert (await client.runs.get(thread_id, slow["run_id"]))["status"] == "interrupted"


async def test_a_rolled_back_run_leaves_the_thread_as_it_was_for_the_next_and_for_a_reader(
    sdk: Any, scripted_model: ScriptedModel
) -> None:
    """``multitask_strategy="rollback"``: the running run is cancelled and its messages removed
    before the new run starts (the model never sees them); cancel with ``action=rollback``
    does the same for a run on its own; the rolled-back runs stay listed as interrupted."""
    client = sdk
    asked = asyncio.Event()
    release = asyncio.Event()
    seen: list[list[str]] = []

    async def answer(body: dict[str, Any]) -> Reply:
        said = [str(m.get("content")) for m in body["messages"] if m["role"] != "system"]
        seen.append(said)
        if said[-1].startswith("slow"):
            asked.set()
            await release.wait()
            return Reply.text("slow answer")
        return Reply.text(f"{said[-1]} answered")

    scripted_model.respond_with(answer)
    thread_id = (await client.threads.create())["thread_id"]
    try:
        await client.runs.wait(thread_id, "support", input={"messages": ["hello"]})
        slow = await client.runs.create(thread_id, "support", input={"messages": ["slow 1"]})
        await asyncio.wait_for(asked.wait(), 20)
        values = await client.runs.wait(
            thread_id, "support", input={"messages": ["quick"]}, multitask_strategy="rollback"
        )
        kept = ["hello", "hello answered", "quick", "quick answered"]
        assert [m["content"] for m in values["messages"]] == kept
        assert seen[-1] == ["hello", "hello answered", "quick"]  # no trace of "slow 1"
        assert (await client.runs.get(thread_id, slow["run_id"]))["status"] == "interrupted"

        asked.clear()
        alone = await client.runs.create(thread_id, "support", input={"messages": ["slow 2"]})
        await asyncio.wait_for(asked.wait(), 20)
        await client.runs.cancel(thread_id, alone["run_id"], wait=True, action="rollback")
        state = await client.threads.get_state(thread_id)
        assert [m["content"] for m in state["values"]["messages"]] == kept
        assert (await client.runs.get(thread_id, alone["run_id"]))["status"] == "interrupted"
    finally:
        release.set()


async def test_a_stream_rejoined_after_its_run_ended_gets_the_rest_of_the_answer(
    sdk: Any, scripted_model: ScriptedModel
) -> None:
    client = sdk
    answer = " ".join(f"part{i}" for i in range(60))
    scripted_model.expect(Reply.text(answer, chunk_delay=0.01))
    thread_id = (await client.threads.create())["thread_id"]
    first = client.runs.stream(
        thread_id, "writer", input={"messages": ["write"]}, stream_mode=["messages-tuple"]
    )
    before = []
    async for part in first:
        before.append(part)
        if part.event == "messages":
            break
    await first.aclose()
    run_id = before[0].data["run_id"]
    await client.runs.join(thread_id, run_id)  # the run has ended
    after = [
        part
        async for part in client.runs.join_stream(
            thread_id, run_id, stream_mode=["messages-tuple"], last_event_id=before[-1].id
        )
    ]
    text = "".join(p.data[0]["content"] for p in before + after if p.event == "messages")
    assert text == answer
    assert after[-1].event == "end" and after[-1].data["status"] == "success"
