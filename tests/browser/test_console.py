"""The operator console as a person uses it: Debian's Chromium driven by Playwright against
``loopwire gateway serve`` in front of a real worker, the broker, Redis, a tool service and the
scripted model. Each test asserts what the page shows (docs/console.md)."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from browser_support import assert_accessible
from gateway_support import GatewayProcess
from playwright.async_api import Page, expect
from redis.asyncio import Redis
from support_rpc import AMQP_URL, wait_until
from tenant_support import drop_intake_queues, trusting_worker

from contracts import topology as t
from contracts.client import LoopwireClient
from contracts.codec import encode
from contracts.dead_letters import list_dead
from contracts.turns import InputMessage, TurnRequest
from harness import WorkerProcess
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

SEEN = 15_000
"""Milliseconds a page has to show what the test waits for (each wait ends as soon as it does)."""


@dataclass
class Console:
    gateway: GatewayProcess
    worker: WorkerProcess
    client: LoopwireClient
    agents_file: Path

    @property
    def url(self) -> str:
        return f"{self.gateway.url}/console"


def _agents(lookup: str) -> dict[str, Any]:
    return {
        "agents": [
            {"name": "support", "description": "Answers questions.", "tools": [lookup]},
            {"name": "careful", "tools": [lookup], "approval": [lookup]},
            {"name": "writer", "tools": [], "stream": True},
            {"name": "lead", "tools": [], "agents": ["researcher"]},
            {"name": "researcher", "description": "Finds facts.", "tools": []},
        ]
    }


@pytest.fixture
async def console(
    scripted_model: ScriptedModel, topology: None, tmp_path: Path, lookup: Any, redis: Redis
) -> AsyncIterator[Console]:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(_agents(lookup.name)))
    prices = json.dumps({"test-model": {"input_per_m": 1000.0, "output_per_m": 1000.0}})
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={"LOOPWIRE_PRICES": prices, "LOOPWIRE_MODEL__MODEL": "test-model"},
    )
    client = LoopwireClient(AMQP_URL)
    async with worker, GatewayProcess(agents, {"ops": None}) as gateway:
        await client.connect()
        try:
            yield Console(gateway, worker, client, agents)
        finally:
            await client.close()
        assert worker.errors() == []
    async for key in redis.scan_iter(match="lw:console:*"):
        await redis.delete(key)


async def sign_in(page: Page, url: str, key: str) -> None:
    await page.goto(f"{url}/login")
    await page.get_by_label("API key").fill(key)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("heading", name="Turns")).to_be_visible()


def row(page: Page, turn_id: str) -> Any:
    return page.locator(f'#turns tr[data-turn="{turn_id}"]')


async def test_a_turn_appears_live_waits_for_approval_and_finishes_when_approved(
    page: Page, console: Console, scripted_model: ScriptedModel, lookup: Any
) -> None:
    """The list is open before the turn exists: its row appears without a reload, parked for
    approval; the call is approved from the inbox; the row turns done, and the turn's page
    shows its steps, the tool call with its arguments and result, and the answer."""
    await sign_in(page, console.url, console.gateway.keys["ops"])
    await assert_accessible(page)
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "shoes"}, "c1")))
    scripted_model.expect(Reply.text("We have shoes.", usage=(40, 5)))
    handle = await console.client.start_turn("careful", "find shoes")
    await expect(row(page, handle.turn_id).locator(".status")).to_have_text(
        "parked (approval)", timeout=SEEN
    )

    await page.get_by_role("link", name="Approvals").click()
    item = page.locator(f'.approval[data-turn="{handle.turn_id}"]')
    await expect(item.get_by_label(f"Arguments of {lookup.name} (c1)")).to_have_value(
        '{"q": "shoes"}'
    )
    await assert_accessible(page)
    await item.get_by_role("button", name="Approve").click()
    await expect(page.get_by_role("status")).to_contain_text("Approve sent")

    await page.get_by_role("link", name="Turns").click()
    await expect(row(page, handle.turn_id).locator(".status")).to_have_text("done", timeout=SEEN)
    await row(page, handle.turn_id).get_by_role("link", name=handle.turn_id).click()
    await expect(page.get_by_role("heading", name="Step 0: model call")).to_be_visible()
    # 40 tokens in and 5 out at $1,000 a million each
    await expect(page.locator('.step[data-step="1"] .meta')).to_contain_text(
        "40 in / 5 out tokens · $0.0450"
    )
    tool = page.locator('.tool[data-call="c1"]')
    await expect(tool.locator(".outcome")).to_have_text("ok")
    await expect(tool.locator(".arguments")).to_contain_text('"q": "shoes"')
    await expect(tool.locator(".result")).to_contain_text("found shoes")
    await expect(page.locator(".answer-final")).to_have_text("We have shoes.")
    await expect(page.locator(".waits")).to_contain_text("approve by console:ops")
    await assert_accessible(page)
    assert sum(lookup.executions.values()) == 1


async def test_a_streaming_answer_shows_as_it_arrives_then_the_result(
    page: Page, console: Console, scripted_model: ScriptedModel
) -> None:
    answer = "Once upon a time a queue carried every word of this story."
    scripted_model.expect(Reply.text(answer, chunk_delay=0.4))
    await sign_in(page, console.url, console.gateway.keys["ops"])
    handle = await console.client.start_turn("writer", "tell a story")
    await row(page, handle.turn_id).get_by_role("link", name=handle.turn_id).click()
    live = page.locator("#live-text")
    # the page may join after the first pieces ("…" stands for what it missed), but the answer
    # streams for seconds: text shows while there is no result yet
    await expect(live).not_to_be_empty(timeout=SEEN)
    await expect(page.locator("#no-result")).to_be_visible()
    await expect(live).to_contain_text("this story.", timeout=SEEN)
    await expect(page.locator(".answer-final")).to_have_text(answer, timeout=SEEN)
    shown = await live.text_content()
    assert shown is not None and answer.endswith(shown.split("…")[-1]), shown


async def test_a_child_turn_opens_in_place_in_its_parents_tree(
    page: Page, console: Console, scripted_model: ScriptedModel
) -> None:
    scripted_model.expect(Reply.tool_calls(("researcher", {"input": "find A"}, "c1")))
    scripted_model.expect(Reply.text("facts on A"))
    scripted_model.expect(Reply.text("combined: facts on A"))
    handle = await console.client.start_turn("lead", "go")
    assert (await handle.result(timeout=20)).content == "combined: facts on A"
    await sign_in(page, console.url, console.gateway.keys["ops"])
    await page.goto(f"{console.url}/turns/{handle.turn_id}")
    tree = page.locator(".tree")
    await expect(tree.locator("summary")).to_contain_text("researcher")
    await tree.locator("summary").click()
    await expect(tree.locator(".subtree .answer-final")).to_have_text("facts on A")
    await expect(page.locator(".waits")).to_contain_text("child.finished")
    await assert_accessible(page)


async def test_a_session_shows_its_turns_and_history_and_is_deleted_once_confirmed(
    page: Page, console: Console, scripted_model: ScriptedModel
) -> None:
    """Keyboard only: the list's link to the session, then the deletion form, which refuses
    until the session's id is typed."""
    scripted_model.expect(Reply.text("Hello there."))
    handle = await console.client.start_turn("support", "hello")
    result = await handle.result(timeout=20)
    await sign_in(page, console.url, console.gateway.keys["ops"])
    session_link = row(page, handle.turn_id).get_by_role("link", name=result.session_id)
    await session_link.focus()
    await page.keyboard.press("Enter")
    await expect(page.get_by_role("heading", name=f"Session {result.session_id}")).to_be_visible()
    await expect(page.locator(".history")).to_contain_text("Hello there.")
    await expect(page.get_by_role("link", name=handle.turn_id)).to_be_visible()
    await assert_accessible(page)
    confirm = page.get_by_label("Type the session's id to confirm")
    await confirm.fill("not-it")
    await confirm.press("Enter")
    await expect(page.get_by_role("alert")).to_contain_text("type the session's id")
    await page.get_by_label("Type the session's id to confirm").fill(result.session_id)
    await page.get_by_role("button", name="Delete session").press("Enter")
    await expect(page.get_by_role("status")).to_contain_text(f"Session {result.session_id} deleted")
    assert await console.client.sessions.get(result.session_id) is None


async def test_an_edited_call_runs_with_the_new_arguments(
    page: Page, console: Console, scripted_model: ScriptedModel, lookup: Any
) -> None:
    """The editor says when the arguments do not fit the tool's schema, and refuses to send
    them; fixed, they are sent, and the tool runs with them."""
    await sign_in(page, console.url, console.gateway.keys["ops"])
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "shoes"}, "c1")))
    scripted_model.expect(Reply.text("We have boots."))
    handle = await console.client.start_turn("careful", "find shoes")
    await expect(row(page, handle.turn_id).locator(".status")).to_have_text(
        "parked (approval)", timeout=SEEN
    )
    await page.goto(f"{console.url}/approvals")
    item = page.locator(f'.approval[data-turn="{handle.turn_id}"]')
    editor = item.get_by_label(f"Arguments of {lookup.name} (c1)")
    await editor.fill('{"q": 7}')
    await expect(item.locator(".check")).to_contain_text("q: 7 is not of type 'string'")
    await item.get_by_role("button", name="Run with these arguments").click()
    await expect(page.get_by_role("alert")).to_contain_text("not sent")
    item = page.locator(f'.approval[data-turn="{handle.turn_id}"]')
    await item.get_by_label(f"Arguments of {lookup.name} (c1)").fill('{"q": "boots"}')
    await expect(item.locator(".check")).to_have_text("Valid for the tool's schema.")
    await item.get_by_role("button", name="Run with these arguments").click()
    await expect(page.get_by_role("status")).to_contain_text("Edit sent")
    assert (await handle.result(timeout=20)).content == "We have boots."
    assert [r.arguments for r in lookup.received] == [{"q": "boots"}]


async def test_a_cancel_from_the_turns_page_ends_it_and_is_recorded(
    page: Page, console: Console, scripted_model: ScriptedModel, lookup: Any
) -> None:
    await sign_in(page, console.url, console.gateway.keys["ops"])
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "shoes"}, "c1")))
    handle = await console.client.start_turn("careful", "find shoes")
    await expect(row(page, handle.turn_id).locator(".status")).to_have_text(
        "parked (approval)", timeout=SEEN
    )
    await page.goto(f"{console.url}/turns/{handle.turn_id}")
    await page.get_by_label("Reason").fill("customer left")
    await page.get_by_role("button", name="Cancel turn").click()
    await expect(page.get_by_role("status")).to_contain_text("Cancel sent: customer left")
    result = await handle.result(timeout=20)
    assert (result.finish_reason, result.stopped_by) == ("cancelled", "customer left")
    await expect(page.locator("#turn-status")).to_have_text("done", timeout=SEEN)
    await page.get_by_role("link", name="Actions").click()
    actions = page.get_by_role("table")
    await expect(actions).to_contain_text("console:ops")
    await expect(actions).to_contain_text(handle.turn_id)
    await assert_accessible(page)
    assert lookup.executions == {}


async def test_dead_letters_are_shown_decoded_replayed_and_purged(
    page: Page, console: Console, scripted_model: ScriptedModel
) -> None:
    """Turns for agents the workers do not know are dead-lettered; the page shows them by
    reason with their decoded bodies; once one agent exists, a replay from the page runs its
    turn; the other letter is purged."""
    late, never = f"t-{uuid.uuid4().hex[:10]}", f"t-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        for turn_id, agent in ((late, "latecomer"), (never, "nobody")):
            request = TurnRequest(
                turn_id=turn_id,
                session_id=f"s-{uuid.uuid4().hex[:8]}",
                agent=agent,
                input=(InputMessage(content="hello"),),
            )
            await channel.default_exchange.publish(
                aio_pika.Message(encode(request), message_id=turn_id), routing_key=t.TURNS_QUEUE
            )

    async def both_dead() -> bool:
        return {late, never} <= {d.turn_id for d in await list_dead(AMQP_URL)}

    await wait_until(both_dead, timeout=20)
    await sign_in(page, console.url, console.gateway.keys["ops"])
    await page.goto(f"{console.url}/dead-letters")
    letter = page.locator(".letter").filter(has_text=late)
    await expect(letter).to_contain_text("latecomer")
    await letter.get_by_text("Body and headers").click()
    await expect(letter.locator(".body")).to_contain_text('"agent": "latecomer"')
    await assert_accessible(page)

    agents = json.loads(console.agents_file.read_text())
    agents["agents"].append({"name": "latecomer", "tools": []})
    console.agents_file.write_text(json.dumps(agents))
    assert console.worker.proc is not None
    console.worker.proc.send_signal(signal.SIGHUP)
    await wait_until(lambda: "reloaded" in console.worker.log_path.read_text(), timeout=20)
    scripted_model.expect(Reply.text("Hello at last."))
    await letter.get_by_role("button", name="Replay").click()
    await expect(page.get_by_role("status")).to_contain_text("replayed to the turn queue")
    await expect(page.locator(".letter").filter(has_text=late)).to_have_count(0)

    gone = page.locator(".letter").filter(has_text=never)
    await gone.get_by_role("button", name="Purge").click()
    await expect(page.get_by_role("status")).to_contain_text("purged")
    await expect(page.locator(".letter").filter(has_text=never)).to_have_count(0)
    assert never not in {d.turn_id for d in await list_dead(AMQP_URL)}
    recent = page.get_by_role("heading", name="Recent replays and purges").locator("xpath=..")
    await expect(recent).to_contain_text("dead-letter.purge")
    await page.goto(f"{console.url}/turns/{late}")
    await expect(page.locator(".answer-final")).to_have_text("Hello at last.", timeout=SEEN)


async def test_a_key_sees_its_tenants_turns_only_and_an_admin_switches(
    page: Page, scripted_model: ScriptedModel, topology: None, tmp_path: Path, redis: Redis
) -> None:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    worker = trusting_worker(scripted_model, agents, ("acme", "globex"))
    keys = {"acme-key": "acme", "globex-key": "globex", "root": None}
    async with worker, GatewayProcess(agents, keys, admins=("root",)) as gateway:
        acme = LoopwireClient(AMQP_URL, tenant="acme")
        await acme.connect()
        try:
            scripted_model.expect(Reply.text("for acme"))
            handle = await acme.start_turn("support", "hi")
            assert (await handle.result(timeout=20)).content == "for acme"
        finally:
            await acme.close()
        url = f"{gateway.url}/console"
        await page.goto(f"{url}/login")
        await assert_accessible(page)
        await sign_in(page, url, gateway.keys["acme-key"])
        await expect(row(page, handle.turn_id)).to_have_count(1, timeout=SEEN)
        await page.get_by_role("button", name="Sign out").click()
        await sign_in(page, url, gateway.keys["globex-key"])
        await expect(page.locator("#tenant")).to_have_text("globex")
        await expect(row(page, handle.turn_id)).to_have_count(0)
        await page.goto(f"{url}/turns/{handle.turn_id}")
        await expect(page.get_by_role("heading", name="Not found")).to_be_visible()
        await assert_accessible(page)
        await page.goto(f"{url}/")
        await page.get_by_role("button", name="Sign out").click()
        await sign_in(page, url, gateway.keys["root"])
        await page.get_by_label("Tenant").select_option("acme")
        await page.get_by_role("button", name="Switch").click()
        await expect(row(page, handle.turn_id)).to_have_count(1, timeout=SEEN)
        await assert_accessible(page)
        assert worker.errors() == []
    for tenant in ("acme", "globex"):
        async for key in redis.scan_iter(match=f"lw:{{{tenant}/*"):
            await redis.delete(key)
    async for key in redis.scan_iter(match="lw:console:*"):
        await redis.delete(key)
    drop_intake_queues(("acme", "globex"))
