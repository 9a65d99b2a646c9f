"""``--scenario tenants``: the noisy neighbour, over the real broker and Redis.

One loopwire worker with tenancy on and every tenant's running turns capped
(``LOOPWIRE_TENANTS__MAX_RUNNING``, ``Plan.tenant_cap``); the bench model answers every request
after ``Plan.tenant_delay_s``. Two tenants, each a RabbitMQ user of its own (created for the run
in the bench's vhost with the shipped publisher's permissions and a topic permission on its own
events, as docs/tenants.md describes, and deleted afterwards), publish through
``LoopwireClient(url, tenant=...)``: tenant A publishes ``backlog`` turns at once, then tenant B
publishes one. Each tenant has an intake queue of its own (``LOOPWIRE_TENANTS__INTAKE``'s
default: the tenants the users map to), so A's backlog waits in A's queue, not ahead of B's
turn. Each turn is one model call (the agent ``bench_tenant`` has no tools; the model
answers it with text), on a fresh session.

For every backlog (``Plan.tenant_backlogs``, 0 first: B alone) it reports how long B's turn
took from its publish to its ``turn.started`` event and to its result; whether all of A's turns
completed and how long A's backlog took to drain against the least the cap allows
(``backlog / cap × delay``); the most model calls in flight at once (sampled); and the worker's
CPU: up to B's start, per A turn published before B (an accept and an admission script for
each of A's turns the worker took meanwhile, plus the few that started and ended), and over the
whole run, per A turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from contracts import topology as t
from contracts.client import LoopwireClient
from contracts.codec import decode
from contracts.turns import InputMessage, TurnRequest, TurnResult
from tests.bench.procs import ROOT, Proc
from tests.bench.report import median, table
from tests.bench.targets import LoopwireTarget
from tests.bench.workload import AMQP_URL, turn_input

AGENT = "bench_tenant"
"""The agent of the scenario's turns: no tools, so the model answers each turn with text."""


def vhost_of(url: str) -> str:
    """The vhost of an AMQP URL (``/`` when it names none)."""
    path = urlsplit(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def user_url(url: str, user: str, password: str) -> str:
    """``url`` (host, port, vhost) logged in as ``user``."""
    address = urlsplit(url)
    where = f"{address.hostname}:{address.port or 5672}/{quote(vhost_of(url), safe='')}"
    return f"{address.scheme}://{user}:{password}@{where}"


async def _rabbitmqctl(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        "-q",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    if proc.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {args[0]} failed: {(err or out).decode()[-500:]}")


@contextlib.asynccontextmanager
async def tenant_users(run_id: str, names: tuple[str, ...]) -> AsyncIterator[dict[str, str]]:
    """Tenant -> the AMQP URL of a user of its own in the bench's vhost, with the shipped
    publisher's permissions (``deploy/rabbitmq/definitions.json``) and a topic permission
    binding only its own events; deleted afterwards."""
    definitions = json.loads((ROOT / "deploy/rabbitmq/definitions.json").read_text())
    (grant,) = (g for g in definitions["permissions"] if g["user"] == "loopwire-publisher")
    vhost = vhost_of(AMQP_URL)
    users = {
        tenant: (f"lwbench-{tenant}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex) for tenant in names
    }
    created: list[str] = []
    try:
        for user, password in users.values():
            await _rabbitmqctl("add_user", user, password)
            created.append(user)
        steps = []
        for tenant, (user, _) in users.items():
            steps.append(
                _rabbitmqctl(
                    "set_permissions",
                    "-p",
                    vhost,
                    user,
                    grant["configure"],
                    grant["write"],
                    grant["read"],
                )
            )
            # its own events to bind (read), its own intake key to publish with (write)
            for exchange, write, read in (
                (t.EVENTS_EXCHANGE, "^$", f"^{tenant}\\."),
                (t.INTAKE_EXCHANGE, f"^{tenant}\\.turns$", "^$"),
            ):
                steps.append(
                    _rabbitmqctl("set_topic_permissions", "-p", vhost, user, exchange, write, read)
                )
        await asyncio.gather(*steps)
        yield {tenant: user_url(AMQP_URL, user, pw) for tenant, (user, pw) in users.items()}
    finally:
        await asyncio.gather(
            *(_rabbitmqctl("delete_user", user) for user in created), return_exceptions=True
        )


@dataclass
class Round:
    """One backlog: what B waited and what A's backlog took."""

    backlog: int
    b_started_s: float = float("nan")
    b_result_s: float = float("nan")
    a_published_s: float = 0.0
    """How long A's publishes took (all confirmed), before B published."""
    a_done: int = 0
    a_drain_s: float = float("nan")
    """From A's first publish to A's last result."""
    ideal_drain_s: float = 0.0
    most_in_flight: int = 0
    """The most model calls waiting at once, sampled every 0.1 s (A's and B's)."""
    cpu_ahead_s: float = 0.0
    """Worker CPU from A's first publish to B's ``turn.started``."""
    cpu_all_s: float = 0.0
    """Worker CPU from A's first publish to the last result (A's and B's)."""
    health: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_ahead_ms_per_turn(self) -> float:
        return 1000 * self.cpu_ahead_s / self.backlog if self.backlog else float("nan")

    @property
    def cpu_ms_per_turn(self) -> float:
        return 1000 * self.cpu_all_s / (self.backlog + 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "backlog": self.backlog,
            "b_started_ms": round(1000 * self.b_started_s, 1),
            "b_result_ms": round(1000 * self.b_result_s, 1),
            "a_published_s": round(self.a_published_s, 3),
            "a_done": self.a_done,
            "a_drain_s": round(self.a_drain_s, 3),
            "ideal_drain_s": round(self.ideal_drain_s, 3),
            "most_in_flight": self.most_in_flight,
            "worker_cpu_ahead_of_b_s": round(self.cpu_ahead_s, 3),
            "worker_cpu_ahead_of_b_ms_per_a_turn": round(self.cpu_ahead_ms_per_turn, 3),
            "worker_cpu_s": round(self.cpu_all_s, 3),
            "worker_cpu_ms_per_turn": round(self.cpu_ms_per_turn, 3),
            "health": self.health,
        }


def bound(rounds: list[Round]) -> dict[str, float]:
    """How B's wait for its start grows with A's backlog: the extra wait per A turn ahead of it
    (least squares over the backlogs, through the backlog-0 wait; and between the two largest
    backlogs, where a wait bounded by the work in hand, not the backlog, stops growing), and
    the worker CPU per A turn ahead of it (the median over backlogs > 0)."""
    by = {r.backlog: r for r in rounds}
    base = by[0].b_started_s if 0 in by else 0.0
    loaded = [r for r in rounds if r.backlog > 0 and r.b_started_s == r.b_started_s]
    if not loaded:
        return {"base_ms": round(1000 * base, 2)}
    slope = sum(r.backlog * (r.b_started_s - base) for r in loaded) / sum(
        r.backlog**2 for r in loaded
    )
    tail = sorted(loaded, key=lambda r: r.backlog)[-2:]
    if len(tail) == 2 and tail[1].backlog > tail[0].backlog:
        growth = (tail[1].b_started_s - tail[0].b_started_s) / (tail[1].backlog - tail[0].backlog)
    else:
        growth = slope
    return {
        "base_ms": round(1000 * base, 2),
        "wait_ms_per_a_turn": round(1000 * slope, 4),
        "tail_wait_ms_per_a_turn": round(1000 * growth, 4),
        "cpu_ms_per_a_turn_ahead": round(median([r.cpu_ahead_ms_per_turn for r in loaded]), 4),
    }


class _Replies:
    """One queue of a tenant's client: its turns' results and, bound to it, events."""

    def __init__(self, queue: AbstractQueue, turns: set[str], proc: Proc) -> None:
        self.queue = queue
        self.pending = set(turns)
        self.proc = proc
        self.started: dict[str, tuple[float, float]] = {}
        """turn -> (when its ``turn.started`` arrived, the worker's CPU then)."""
        self.last = float("nan")
        self.bad = 0
        self.done = asyncio.Event()
        if not self.pending:
            self.done.set()

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        now = time.monotonic()
        if message.exchange == t.EVENTS_EXCHANGE:
            turn = (message.routing_key or "").rsplit(".", 1)[-1]
            self.started.setdefault(turn, (now, self.proc.cpu()))
            return
        turn = message.correlation_id or ""
        if turn not in self.pending:
            return
        self.pending.discard(turn)
        self.last = now
        try:
            if decode(message.body, TurnResult).finish_reason != "stop":
                self.bad += 1
        except Exception:
            self.bad += 1
        if not self.pending:
            self.done.set()


async def _one_round(
    a: LoopwireClient,
    b: LoopwireClient,
    tenant_b: str,
    worker: Proc,
    model: Any,
    *,
    backlog: int,
    cap: int,
    delay_s: float,
    tag: str,
) -> Round:
    out = Round(backlog=backlog, ideal_drain_s=-(-backlog // cap) * delay_s)
    a_turns = [f"{tag}-a{i}-{uuid.uuid4().hex[:6]}" for i in range(backlog)]
    b_turn = f"{tag}-b-{uuid.uuid4().hex[:6]}"
    a_queue = await a.channel.declare_queue(
        f"loopwire-client.{uuid.uuid4().hex}", exclusive=True, auto_delete=True
    )
    b_queue = await b.channel.declare_queue(
        f"loopwire-client.{uuid.uuid4().hex}", exclusive=True, auto_delete=True
    )
    await b_queue.bind(t.EVENTS_EXCHANGE, routing_key=f"{tenant_b}.turn.started.*.{b_turn}")
    a_replies = _Replies(a_queue, set(a_turns), worker)
    b_replies = _Replies(b_queue, {b_turn}, worker)
    consumers = [
        (a_queue, await a_queue.consume(a_replies.on_message, no_ack=True)),
        (b_queue, await b_queue.consume(b_replies.on_message, no_ack=True)),
    ]

    def request(turn: str, reply_to: str) -> TurnRequest:
        return TurnRequest(
            turn_id=turn,
            session_id=f"s{turn}",
            agent=AGENT,
            input=(InputMessage(content=turn_input(turn)),),
            reply_to=reply_to,
        )

    a_requests = [request(turn, a_queue.name) for turn in a_turns]
    b_request = request(b_turn, b_queue.name)
    sampling = True

    async def sample() -> None:
        while sampling:
            waiting = (await model.stats())["waiting"]
            out.most_in_flight = max(out.most_in_flight, int(waiting))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    cpu0 = worker.cpu()
    t0 = time.monotonic()
    await asyncio.gather(*(a.publish(r) for r in a_requests))
    out.a_published_s = time.monotonic() - t0
    tb = time.monotonic()
    await b.publish(b_request)
    timeout = 30 + 4 * out.ideal_drain_s + 0.02 * backlog
    try:
        await asyncio.wait_for(b_replies.done.wait(), timeout)
        await asyncio.wait_for(a_replies.done.wait(), timeout)
    except TimeoutError:
        pass
    finally:
        sampling = False
        await sampler
    out.cpu_all_s = worker.cpu() - cpu0
    if b_turn in b_replies.started:
        started_at, cpu_then = b_replies.started[b_turn]
        out.b_started_s = started_at - tb
        out.cpu_ahead_s = cpu_then - cpu0
    out.b_result_s = b_replies.last - tb
    out.a_done = backlog - len(a_replies.pending)
    if backlog:
        out.a_drain_s = a_replies.last - t0
    out.health = {
        "unfinished": len(a_replies.pending) + len(b_replies.pending),
        "bad_results": a_replies.bad + b_replies.bad,
        "b_not_started": int(b_turn not in b_replies.started),
        "over_cap": int(out.most_in_flight > cap + 1),
    }
    for queue, tag in consumers:  # auto-delete: the queue goes with its consumer
        with contextlib.suppress(Exception):
            await queue.cancel(tag)
    return out


async def tenants(ctx: Any) -> dict[str, Any]:
    """The scenario (``ctx``: ``tests.bench.scenarios.Context``)."""
    plan = ctx.plan
    if shutil.which("rabbitmqctl") is None:
        reason = "rabbitmqctl not found: the scenario creates its tenants' RabbitMQ users with it"
        ctx.tables.append(f"Tenants: not run ({reason})")
        return {"not_run": reason}
    cap, delay = plan.tenant_cap, plan.tenant_delay_s
    tenant_a, tenant_b = f"bench-a-{ctx.run_id}", f"bench-b-{ctx.run_id}"
    rounds: list[Round] = []
    async with tenant_users(ctx.run_id, (tenant_a, tenant_b)) as urls:
        mapping = {u.split("//")[1].split(":")[0]: tenant for tenant, u in urls.items()}
        target = LoopwireTarget(
            ctx.shared,
            ctx.model,
            prefetch=plan.prefetch,
            steps=1,
            agents_dir=ctx.agents_dir,
            extra_env={
                "LOOPWIRE_GRACE_S": "3",
                "LOOPWIRE_TENANTS__ENABLED": "true",
                "LOOPWIRE_TENANTS__USERS": json.dumps(mapping),
                "LOOPWIRE_TENANTS__MAX_RUNNING": str(cap),
            },
            source=ctx.source,
            variant="tenants",
            extra_agents=({"name": AGENT, "tools": []},),
        )
        target.profile_dir = ctx.profile_dir
        try:
            await ctx.model.configure(delay=0)
            await target.add_worker()
            (worker,) = target.workers
            async with (
                LoopwireClient(urls[tenant_a], tenant=tenant_a) as a,
                LoopwireClient(urls[tenant_b], tenant=tenant_b) as b,
            ):
                await _one_round(  # warm-up: imports, pools, the scripts loaded
                    a,
                    b,
                    tenant_b,
                    worker,
                    ctx.model,
                    backlog=cap,
                    cap=cap,
                    delay_s=0,
                    tag=f"b{ctx.run_id}-tw",
                )
                await ctx.model.configure(delay=delay)
                for r in range(plan.rounds):
                    order = plan.tenant_backlogs if r % 2 == 0 else plan.tenant_backlogs[::-1]
                    for backlog in order:
                        rounds.append(
                            await _one_round(
                                a,
                                b,
                                tenant_b,
                                worker,
                                ctx.model,
                                backlog=backlog,
                                cap=cap,
                                delay_s=delay,
                                tag=f"b{ctx.run_id}-t{r}n{backlog}",
                            )
                        )
        finally:
            await ctx.model.configure(delay=0)
            target.stop()
            await ctx.shared.purge_work()
            for tenant in (tenant_a, tenant_b):
                for pattern in (
                    f"lw:tenant:{{{tenant}}}:*",
                    f"lw:{{{tenant}/*",
                    f"lw:turn:{tenant}/*",
                ):
                    await ctx.shared.delete_matching(pattern)
    return _report(ctx, rounds, cap=cap, delay=delay)


def _report(ctx: Any, rounds: list[Round], *, cap: int, delay: float) -> dict[str, Any]:
    backlogs = sorted({r.backlog for r in rounds})
    summary: dict[str, Any] = {}
    rows = []
    for backlog in backlogs:
        found = [r for r in rounds if r.backlog == backlog]
        s = {
            "b_started_ms": median([1000 * r.b_started_s for r in found]),
            "b_result_ms": median([1000 * r.b_result_s for r in found]),
            "a_done": min(r.a_done for r in found),
            "a_drain_s": median([r.a_drain_s for r in found]),
            "ideal_drain_s": found[0].ideal_drain_s,
            "most_in_flight": max(r.most_in_flight for r in found),
            "cpu_ahead_ms_per_a_turn": median([r.cpu_ahead_ms_per_turn for r in found]),
            "cpu_ms_per_turn": median([r.cpu_ms_per_turn for r in found]),
        }
        summary[f"backlog_{backlog}"] = s
        rows.append(
            (
                backlog,
                s["b_started_ms"],
                s["b_result_ms"],
                f"{s['a_done']}/{backlog}" if backlog else "-",
                f"{s['a_drain_s']:.1f} ({s['ideal_drain_s']:.1f})" if backlog else "-",
                s["most_in_flight"],
                s["cpu_ahead_ms_per_a_turn"] if backlog else "-",
                s["cpu_ms_per_turn"] if backlog else "-",  # one turn: under a clock tick
            )
        )
    fit = bound(
        [
            Round(backlog=b, b_started_s=summary[f"backlog_{b}"]["b_started_ms"] / 1000)
            for b in backlogs
        ]
    )
    if len(backlogs) > 1:
        fit["cpu_ms_per_a_turn_ahead"] = round(
            median([r.cpu_ahead_ms_per_turn for r in rounds if r.backlog]), 4
        )
    ctx.tables.append(
        table(
            f"Tenants: noisy neighbour, one worker, {cap} running turns per tenant, model answers "
            f"after {delay:g}s, one model call a turn; tenant A publishes <backlog> turns at "
            "once, then tenant B one (medians of rounds; B's wait grows by "
            f"{fit.get('tail_wait_ms_per_a_turn', float('nan')):.3f} ms per A turn between the "
            f"two largest backlogs, {fit.get('wait_ms_per_a_turn', float('nan')):.3f} ms fitted "
            "over all)",
            (
                "backlog",
                "B to started ms",
                "B to result ms",
                "A done",
                "A drain s (least)",
                "max calls at once",
                "cpu ms/A turn ahead of B",
                "cpu ms/turn, all",
            ),
            rows,
        )
    )
    return {
        "cap": cap,
        "delay_s": delay,
        "rounds": [r.as_dict() for r in rounds],
        "median": summary,
        "bound": fit,
    }
