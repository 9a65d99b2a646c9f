"""The world of the sequencer's simulation: the real ``Consumer`` and ``SessionSequencer``
over a ``MemoryStore`` whose clock the simulation moves, a broker of bags (what is published
waits in a bag until the schedule delivers it, in any order, any number of times), a scripted
model and a tool service that stores its replies by idempotency key as the SDK's does.

Nothing here decides what is right: ``tests.unit.simulation.invariants`` does, after a
schedule has run and the world has been let settle.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aio_pika
from prometheus_client import CollectorRegistry

from contracts import topology as t
from contracts.codec import decode, encode
from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.state import ModelResponse
from contracts.tenancy import DEFAULT
from contracts.tools import (
    ToolCallReply,
    ToolCallRequest,
    ToolDefinition,
    idempotency_key,
)
from contracts.turns import TurnRequest
from contracts.work import StepWork
from tests.unit.simulation.faults import Crash, Faults, FaultySlots, FaultyStore
from worker.loop.ports import ModelRequest
from worker.profiles.agents import AgentProfiles
from worker.runtime.metrics import WorkerMetrics
from worker.testing.broker import MemoryDelivery, MemoryPublisher, Published
from worker.testing.memory import ListSink, MemoryStore
from worker.testing.sequencing import sequencer_over
from worker.testing.slots import MemoryTenantSlots
from worker.transport.consumer import Consumer
from worker.transport.publish import properties
from worker.transport.tenants import Tenants

START = 1_800_000_000.0
LEASE_TTL_S = 15.0
SESSION_TTL_S = 3600.0
APPROVAL_TIMEOUT_S = 60.0
BUSY_RETRY_S = 0.5
WAIT_QUEUES = frozenset(t.wait_queue(s) for s in t.WAIT_BUCKETS_S)
WORKER_USER = "loopwire-worker"
"""The workers' AMQP user: the broker vouches for it on what they publish, never on what a
publisher does."""
PUBLISHER = "shop-app"
"""The publishers' AMQP user: tenancy is on, and it is the default tenant's (so the keys are
the ones a fleet without tenancy has, and the tenant's cap on running turns applies)."""
CAP = 2
"""The tenant's running turns at once (``LOOPWIRE_TENANTS__MAX_RUNNING``); child turns take
no slot."""
TOKENS = 10
"""Every model answer's usage."""

DAY = {"max_total_tokens": 1_000_000}
"""A daily budget never spent: the agents' days are counted (``daily_spend``)."""
DAILY = frozenset({"lead", "helper"})
"""The agents with a daily budget."""
PROFILES: dict[str, Any] = {
    "agents": [
        {"name": "support", "system_prompt": "agent:support"},
        {
            "name": "payer",
            "system_prompt": "agent:payer",
            "approval": ["pay"],
            "approval_timeout_s": APPROVAL_TIMEOUT_S,
        },
        {
            "name": "lead",
            "system_prompt": "agent:lead",
            "agents": ["helper"],
            "daily_budget": DAY,
        },
        {
            "name": "boss",
            "system_prompt": "agent:boss",
            "agents": ["helper"],
            "approval": ["helper"],
            "approval_timeout_s": APPROVAL_TIMEOUT_S,
        },
        {"name": "helper", "system_prompt": "agent:helper", "daily_budget": DAY},
        {
            "name": "pool",
            "system_prompt": "agent:pool",
            "agents": [{"agent": "helper", "session": "P"}],
        },
    ]
}
AGENTS = ("support", "payer", "lead", "boss", "pool")
"""The agents a publisher may address (``helper`` runs as the others' sub-agent)."""
FIRST_CALL = {
    "support": "lookup",
    "payer": "pay",
    "lead": "helper",
    "boss": "helper",
    "pool": "helper",
}
"""What each agent calls at its first step; ``helper`` calls ``lookup`` too (``pool``'s
children all run in one named session, ``P``, queued there one after another)."""
DEFINITIONS = [
    ToolDefinition(name="lookup", description="Look something up."),
    ToolDefinition(name="pay", description="Pay.", idempotent=False),
]


def _usage() -> Usage:
    return Usage(prompt_tokens=TOKENS, completion_tokens=0, total_tokens=TOKENS)


class SimModel:
    """Each agent calls its tool once a turn, then answers with what the tool said."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, ModelRequest]] = []

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        agent = (request.messages[0].content or "").removeprefix("agent:")
        self.requests.append((agent, request))
        return self._answer(agent, request)

    @staticmethod
    async def _answer(agent: str, request: ModelRequest) -> ModelResponse:
        last_user = max(i for i, m in enumerate(request.messages) if m.role == "user")
        results = [m.content or "" for m in request.messages[last_user:] if m.role == "tool"]
        if not results:
            tool = FIRST_CALL.get(agent, "lookup")
            call = ToolCall(id="call_0", name=tool, arguments=json.dumps({"input": "q"}))
            return ModelResponse(
                message=ChatMessage(role="assistant", tool_calls=(call,)),
                finish_reason="tool_calls",
                usage=_usage(),
            )
        text = "answer: " + " | ".join(results)
        return ModelResponse(message=ChatMessage(role="assistant", content=text), usage=_usage())


@dataclass(frozen=True, slots=True)
class Execution:
    """One tool call the tool service ran (not answered from its stored replies)."""

    session_id: str
    turn_id: str
    call_id: str
    tool: str
    at: float


class SimTools:
    """A tool service per the SDK's rule: a reply stored under the call's idempotency key is
    returned again, not run again. Its value names the session and turn it ran for."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.stored: dict[str, ToolCallReply] = {}
        self.executions: list[Execution] = []

    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        ctx = request.context
        key = idempotency_key(ctx.turn_id, request.call_id)
        stored = self.stored.get(key)
        if stored is not None:
            return stored.model_copy(update={"call_id": request.call_id})
        self.executions.append(
            Execution(ctx.session_id, ctx.turn_id, request.call_id, request.tool, self.world.now)
        )
        value = {"items": [f"{request.tool} for {ctx.session_id}/{ctx.turn_id}"]}
        reply = ToolCallReply(call_id=request.call_id, status="ok", value=value)
        self.stored[key] = reply
        return reply


@dataclass
class Message:
    """A message on the broker: where it waits and how many times it was delivered."""

    published: Published
    deliveries: int = 0
    due: float = 0.0
    """Not delivered before this time (a wait queue's message)."""
    at: float = 0.0
    """When it was published."""

    @property
    def kind(self) -> str:
        return str(self.published.headers.get(t.H_KIND, t.KIND_START))


@dataclass
class World:
    now: float = START
    faults: Faults = field(default_factory=Faults)
    bag: list[Message] = field(default_factory=list)
    """What waits on ``loopwire.turns`` (and the retry and wait queues, which lead there)."""
    replies: dict[str, list[bytes]] = field(default_factory=dict)
    """What reached each reply queue."""
    dead: list[Published] = field(default_factory=list)
    delivered: list[tuple[Message, str]] = field(default_factory=list)
    """Every delivery, with the fault that struck it (``""``: none)."""

    def __post_init__(self) -> None:
        self.memory = MemoryStore(lease_ttl_s=LEASE_TTL_S, clock=self.clock, ttl_s=SESSION_TTL_S)
        self.store = FaultyStore(self.memory, self.faults)
        self.slots = MemoryTenantSlots(default_cap=CAP, lapse_s=SESSION_TTL_S)
        self.model = SimModel()
        self.tools = SimTools(self)
        self.events = ListSink()
        self.publisher = MemoryPublisher()
        self.dead_letters = MemoryPublisher()
        # the tenant's own intake queue: its publishers' requests and its steps go there
        self.intake = MemoryPublisher(t.INTAKE_EXCHANGE, into=self.publisher.published)
        self.sequencer = sequencer_over(
            self.store,  # type: ignore[arg-type]
            model=self.model,
            tools=self.tools,
            definitions=DEFINITIONS,
            events=self.events,
            agents=AgentProfiles.model_validate(PROFILES).agents,
            clock=self.clock,
            ledger=self.store,  # type: ignore[arg-type]
            slots=FaultySlots(self.slots, self.faults),  # type: ignore[arg-type]
        )
        self.consumer = Consumer(
            work=self.sequencer,
            publisher=self.publisher,
            dead_letters=self.dead_letters,
            events=self.events,
            busy_retry_s=BUSY_RETRY_S,
            metrics=WorkerMetrics(CollectorRegistry()),
            user=WORKER_USER,
            tenants=Tenants(enabled=True, users={PUBLISHER: DEFAULT}, trusted={WORKER_USER}),
            intake=self.intake,
            lanes=frozenset({DEFAULT}),
        )

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Time passes, but never past the idle lifetime of a session with a turn to run (a
        minute short of ``SESSION_TTL_S`` after anything renewed any of its keys), nor of a
        message waiting to be delivered: a session idle that long is gone, as documented,
        whatever it held."""
        live = [self._active(s) for s, q in self.memory.queues.items() if q]
        waiting = [m.at for m in self.bag]  # the broker delivers well within that, too
        bound = min((at + SESSION_TTL_S - 60 for at in live + waiting), default=self.now + seconds)
        self.now = max(self.now, min(self.now + seconds, bound))

    def _active(self, session: str) -> float:
        """When anything last renewed a key of ``session``."""
        tag = "{" + session + "}"
        renewed = self.memory.keys.renewed
        return max((at for k, at in renewed.items() if tag in k), default=self.now)

    # -- publishing, as a publisher does -----------------------------------------------------

    def publish(self, body: bytes, kind: str, message_id: str = "") -> None:
        props = properties(
            content_type=t.CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers={t.H_KIND: kind},
            message_id=message_id or None,
            user_id=PUBLISHER,
        )
        # as the client acting for its tenant: through the intake, into the tenant's queue
        lane = Published(t.intake_key(DEFAULT), body, props, True, t.INTAKE_EXCHANGE)
        self.bag.append(Message(lane, at=self.now))

    def publish_turn(self, request: TurnRequest) -> None:
        self.publish(encode(request), t.KIND_START, request.turn_id)

    # -- delivering, as the broker does -----------------------------------------------------

    def deliverable(self) -> list[int]:
        return [i for i, m in enumerate(self.bag) if m.due <= self.now]

    async def deliver(self, index: int, *, ack_lost: bool = False) -> str:
        """Deliver the bag's message ``index`` to the consumer, with the armed fault; what
        happened (``""``: it was handled and acked). A crashed delivery (or one whose ack was
        lost) stays in the bag and comes again, counted, as a quorum queue redelivers it."""
        message = self.bag[index]
        delivery = MemoryDelivery.of(
            message.published,
            headers={"x-delivery-count": message.deliveries} if message.deliveries else None,
        )
        delivery.redelivered = message.deliveries > 0
        message.deliveries += 1
        before = len(self.publisher.published)
        crashed = False
        try:
            await self.consumer.handle(delivery)  # type: ignore[arg-type]
        except Crash:
            crashed = True
            del self.publisher.published[before:]  # a dead worker's publishes never happened
        fired = self.faults.fired or ("ack lost" if ack_lost else "")
        self.faults.arm()
        self._route(self.publisher.published[before:])
        self._route_dead()
        if not crashed and not ack_lost:
            assert delivery.settlements == 1, "a delivery is settled exactly once"
            self.bag.pop(index)
        self.delivered.append((message, fired))
        return fired

    def _route(self, published: list[Published]) -> None:
        for p in published:
            if p.routing_key == t.TURNS_QUEUE or p.exchange == t.INTAKE_EXCHANGE:
                self.bag.append(Message(p, at=self.now))
            elif p.routing_key == t.RETRY_QUEUE:  # back after the retry delay
                self.bag.append(Message(p, due=self.now + BUSY_RETRY_S, at=self.now))
            elif p.routing_key in WAIT_QUEUES:
                # back at its time, or up to a second early (the wait queues' delays are whole
                # seconds, and the workers' clocks differ): an early one hops on
                work = decode(p.body, StepWork)
                until = work.wait_until if work.wait_until is not None else self.now
                early = max(self.now + min(1.0, until - self.now), until - 1.0)
                self.bag.append(
                    Message(p, due=self.now if until <= self.now else early, at=self.now)
                )
            else:
                self.replies.setdefault(p.routing_key, []).append(p.body)

    def _route_dead(self) -> None:
        self.dead.extend(self.dead_letters.published)
        self.dead_letters.published.clear()

    async def settle(self, limit: int = 3000) -> None:
        """Deliver everything, without faults, moving the clock to the next message due (a
        wait, a lease left by a dead worker) when nothing else is: until the bag is empty."""
        while self.bag and limit:
            limit -= 1
            ready = self.deliverable()
            if not ready:
                self.now = min(m.due for m in self.bag)
                continue
            fired = await self.deliver(ready[0])
            assert not fired
        assert not self.bag, f"the world did not settle: {len(self.bag)} messages left"


def run(coro: Awaitable[Any], loop: asyncio.AbstractEventLoop) -> Any:
    return loop.run_until_complete(coro)  # type: ignore[arg-type]
